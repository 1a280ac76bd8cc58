"""OVQ configuration and its dictionary's growth schedule (docs/ovq.md, spec ovq.md 3.2, 6)."""

from __future__ import annotations

from dataclasses import dataclass

from longkv.checks import require

SCHEDULES: tuple[str, ...] = ("saturating", "min")


@dataclass(frozen=True)
class OVQConfig:
    """Online vector-quantised attention (the KVM paper's OVQ baseline).

    chunk_len: C, tokens per chunk (a chunk joins the dictionary when it is complete);
    max_centroids: M, the schedule's asymptote (saturating) or cap (min); schedule: the
    dictionary's size after t committed tokens, "saturating" floor(M t / (M + t)) (the paper's)
    or "min" min(t, M) (lossless until M tokens); count_bias: add log(count) to a centroid's
    logit, so a centroid weighs like the tokens it holds (the paper's; off: the count only sets
    the step of its running mean).
    """

    chunk_len: int = 256
    max_centroids: int = 1024
    schedule: str = "saturating"
    count_bias: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_len", "max_centroids"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1, self, name,
                f"must be an int >= 1, got {value!r}",
            )  # fmt: skip
        require(
            self.schedule in SCHEDULES, self, "schedule",
            f"must be one of {SCHEDULES}, got {self.schedule!r}",
        )  # fmt: skip

    def size(self, tokens: int) -> int:
        """Centroids the dictionary holds after `tokens` committed tokens (a multiple of C)."""
        M = self.max_centroids
        if self.schedule == "min":
            return min(tokens, M)
        return M * tokens // (M + tokens)

    @classmethod
    def paper(cls, **overrides: object) -> OVQConfig:
        """The paper's OVQ layer: C = 256, M = 1024, saturating, with the log-count bias."""
        return cls(**{"chunk_len": 256, "max_centroids": 1024, **overrides})  # type: ignore[arg-type]
