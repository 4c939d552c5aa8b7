"""The batch of a CP step (cpshard.batch): documents from every format, positions, labels."""
