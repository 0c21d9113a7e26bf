"""The rollout side, on the driver only: engines (embedded, SGLang), the agents that wrap them, data,
rewards and shaping, and the producer that turns prompts into a packed ``RolloutBatch``. It never
imports megatron-core or the policy side."""
