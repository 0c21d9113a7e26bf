"""The typed data that crosses between the roles: samples, the step's rollout batch and its layout into
micro-batches, each rank's share with the whole batch's denominators, the phases' results and the
weight stream. Below both the rollout side and the policy side, so neither imports the other."""
