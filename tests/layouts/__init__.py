"""The sharding layouts and ShardLayout (cpshard.layouts)."""
