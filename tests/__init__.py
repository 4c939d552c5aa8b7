"""cpshard's tests, one folder per package (``tests/<package>/test_<module or concept>.py``);
shared references and instruments in :mod:`tests.helpers`, rank pools in ``conftest.py``."""
