"""The guard against token mixing cpshard does not shard.

Inside a CP step each rank holds a slice of every packed sequence; a layer that mixes tokens
by its own code would train on that slice alone, wrong and without an error. The guard refuses
such models on every rank, by what they do rather than what they are called:

* :mod:`~cpshard.guard.models`: the checks a model gets the first time it runs in a CP
  context (its modules' parameters before it runs, an audit of its forward after);
* :mod:`~cpshard.guard.reach`: which module calls of the audited forward reached cpshard;
* :mod:`~cpshard.guard.probe`: whether a module call mixes tokens, found by re-running it;
* :mod:`~cpshard.guard.refusals`: layer classes known not to run exactly under CP in this
  environment, with the reason (an integration's hooks that do not match the installed
  library, a layer whose token selection cpshard does not shard).

It reads the active step through the reader the attention package hands it
(:func:`~cpshard.guard.models.guard_models`), so that it imports nothing of the attention.
"""
