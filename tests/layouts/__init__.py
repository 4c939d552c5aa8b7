"""The sharding layouts and ShardLayout (cpshard.layout, cpshard.balance)."""
