"""transformers' ``Trainer`` with ``DataCollatorWithFlattening`` (padding-free rows of several
documents) under cpshard context parallelism, on CPU:

    torchrun --nproc-per-node 2 examples/trainer_flattening.py [--steps 4]

Every rank trains a tiny random Llama (float64) with ``CPTrainer`` (cp = the number of ranks),
used exactly like ``Trainer`` plus ``cp_size``::

    trainer = CPTrainer(model=model, args=TrainingArguments(..., use_cpu=True), cp_size=2,
                        data_collator=DataCollatorWithFlattening(), train_dataset=dataset)
    trainer.train()

Rank 0 then runs the plain ``Trainer`` in one process on the same data and prints each step's
loss beside it, and the evaluation loss. The set-up is in ``tiny_training.py`` beside this file.
"""

import tiny_training

if __name__ == "__main__":
    tiny_training.main("trainer")
