"""TRL's ``SFTTrainer`` with ``packing=True`` under cpshard context parallelism, on CPU:

    torchrun --nproc-per-node 2 examples/sft_trl.py [--steps 4]

Every rank trains a tiny random Llama (float64) with ``CPSFTTrainer`` (cp = the number of
ranks): the ranks share each packed row of documents, ``CPSFTTrainer`` shards it, and the
``"cpshard"`` attention keeps every document to itself across the ranks. Rank 0 then runs the
plain ``SFTTrainer`` in one process on the same data and prints each step's loss beside it, and
the evaluation loss. The trainer is used exactly like ``SFTTrainer``::

    trainer = CPSFTTrainer(model=model, args=SFTConfig(..., packing=True), cp_size=2,
                           train_dataset=dataset, processing_class=tokenizer)
    trainer.train()

The set-up (model, tokenizer, documents, arguments) is in ``tiny_training.py`` beside this file.
"""

import tiny_training

if __name__ == "__main__":
    tiny_training.main("sft")
