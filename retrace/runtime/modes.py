"""The decoding modes a request can ask for (`--mode`, `generate(mode=...)`, the server's `mode` field).

- ``"ar"``: the target alone, one token per target call (autoregressive); no drafter needed. The reference:
  at temperature 0 every other mode gives exactly its tokens.
- ``"dflash"``: DFlash speculative decoding: each round the drafter proposes a block after the anchor (the
  last committed token) from the target's hidden features, the target verifies the block in one call, and
  the drafts it accepts plus one token of its own are committed. Needs a drafter.
- ``"retrace"``: dflash whose drafter is also conditioned on the rejected suffix of the previous round (the
  ReTrace conditioner, retrace.models.conditioner). Needs a drafter with a conditioner.

Order matters where the modes are listed (the scheduler's per-mode stats, the bench's system names).
"""

MODES = ("ar", "dflash", "retrace")

__all__ = ["MODES"]
