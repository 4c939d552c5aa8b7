"""Vision frame sharding (cpshard.vision): the planner and config, the distributed tower call."""
