"""The RL loop: the step read top to bottom, and the composition root that builds the policy on every
rank and the rollout side on the driver."""
