"""Memory and precision: the step's peak, recomputation, ZeRO stages, offload, mixed precision."""
