"""CP attention (cpshard.attention): every layout against a dense reference, blocks, tokens."""
