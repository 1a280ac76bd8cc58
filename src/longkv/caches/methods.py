"""The methods a command runs a frozen model with, and the options of the bounded ones.

`full` (one forward) and `fold` (KV-Fold) keep every token; `streaming`, `snapkv` and
`kvm-fold` keep at most a budget of entries per layer and KV head, and run once per budget in
`budgets` (kvm-fold also once per state budget in `kvm_states`). Each run has a label:
`streaming@1024`, `snapkv@1024`, `kvm-fold/sqrt@1024`, or for two-level KVM-Fold (each of
`kvm_open` slots opened per query head) `kvm-fold/sqrt/open8@1024`, with its leaf store, slot
key and slot score named unless the defaults (`kvm-fold/sqrt/open8/int8/centred/box@1024`); the
leaves are outside the budget. `quest` (pages of the tokens that left the window, each query
head opening the best by their key bounds) and `infllm` (blocks of them, retrieved by
representative keys) run once per budget, `quest@1024`, `infllm@1024`, their sinks and window
those of kvm-fold at the same budget and their pages and blocks outside it. With `positions`
inside, the retrieval runs' labels say so: `kvm-fold/sqrt/open8/inside@1024`,
`quest/inside@1024`, `infllm/inside@1024`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from longkv.caches.bounded import (
    STREAM_CHUNK,
    BoundedConfig,
    BoundedRunner,
    bounded_fold,
    bounded_generate,
)
from longkv.caches.eviction import SnapKVConfig, SnapKVRunner
from longkv.caches.infllm import InfLLMConfig, InfLLMRunner
from longkv.caches.kvm_fold import STATES, KVMFoldConfig, KVMFoldRunner
from longkv.caches.leaves import LEAF_STORES
from longkv.caches.model import check_bounded, check_budget
from longkv.caches.quest import QuestConfig, QuestRunner
from longkv.caches.retrieval import RetrievalRunner, places_inside
from longkv.caches.routed import POSITIONS, ROUTINGS
from longkv.caches.streaming import StreamingRunner
from longkv.caches.two_level import TwoLevelRunner
from longkv.checks import mirror, refused_as, require, require_at_least, setting
from longkv.decoding import Pick, greedy
from longkv.fold.fold import FOLD_CHUNK, FoldResult
from longkv.fold.generate import fold_generate
from longkv.results import markdown_table

BOUNDED = ("streaming", "snapkv", "kvm-fold", "quest", "infllm")
# how a frozen model holds a long input's keys and values
CACHE_METHODS = ("full", "fold", *BOUNDED)


@dataclass(frozen=True)
class BoundedOptions:
    """Options of the bounded methods (settings classes of commands inherit them)."""

    budgets: tuple[int, ...] = setting(
        (1024,),
        "entries per layer and KV head of the bounded methods (streaming, snapkv, kvm-fold, "
        "quest, infllm; the leaves of two-level kvm-fold, quest and infllm outside it), each "
        "run once per budget",
        feeds=(BoundedConfig, "budget"),
    )
    sinks: int = setting(4, "first tokens the bounded methods keep", feeds=(BoundedConfig, "sinks"))
    window: int | None = setting(
        None,
        "recent tokens snapkv, kvm-fold, quest and infllm keep exactly, the chunk included "
        "(default: half the budget); streaming keeps budget - sinks",
        feeds=(BoundedConfig, "window"),
    )
    stream_chunk: int = setting(STREAM_CHUNK, "chunk of the bounded methods (1 = token by token)")
    kvm_states: tuple[str, ...] = setting(
        ("fixed",),
        "state budgets of kvm-fold, each run once",
        choices=STATES,
        feeds=(KVMFoldConfig, "state"),
    )
    kvm_growth_factor: float = mirror(KVMFoldConfig, "growth_factor", "kvm-fold ")
    kvm_readout: str = mirror(KVMFoldConfig, "readout", "kvm-fold: ")
    kvm_count_bias: bool = mirror(KVMFoldConfig, "count_bias", "kvm-fold: ")
    kvm_merge_threshold: float | None = mirror(KVMFoldConfig, "merge_threshold", "kvm-fold: ")
    kvm_slot_cap: float | None = mirror(KVMFoldConfig, "slot_cap", "kvm-fold: ")
    kvm_open: tuple[int, ...] = setting(
        (0,),
        "kvm-fold: two-level KVM-Fold: slots each query head opens to the exact tokens they "
        "own, ranked by its logit against their mean key + log(count), each run once (0: the "
        "coarse state alone)",
        feeds=(KVMFoldConfig, "open"),
    )
    kvm_leaves: tuple[str, ...] = setting(
        ("exact",),
        "kvm-fold: two-level KVM-Fold: the stores of the tokens that left the window, each run "
        "once (exact, int8 or file: KVMFoldConfig.leaves)",
        choices=LEAF_STORES,
        feeds=(KVMFoldConfig, "leaves"),
    )
    kvm_slot_key: str = mirror(KVMFoldConfig, "slot_key", "kvm-fold: ")
    kvm_slot_score: str = mirror(KVMFoldConfig, "slot_score", "kvm-fold: ")
    kvm_slot_variance: float = mirror(KVMFoldConfig, "slot_variance", "kvm-fold: ")
    kvm_rerank: int = mirror(KVMFoldConfig, "rerank", "kvm-fold: ")
    kvm_readouts: bool = mirror(KVMFoldConfig, "readouts", "kvm-fold: ")
    kvm_leaf_dir: str | None = mirror(KVMFoldConfig, "leaf_dir", "kvm-fold: ")
    kvm_lod_factor: float = mirror(KVMFoldConfig, "lod_factor", "kvm-fold ")
    kvm_lod_floor: int = mirror(KVMFoldConfig, "lod_floor", "kvm-fold ")
    routing: str = setting(
        "block",
        "retrieval methods (two-level kvm-fold, quest): who opens units in a prefill chunk: "
        "block (its queries together, the units they give the largest shares of attention, "
        "within --leaf-budget) or token (each query head and query its own best); a decoded "
        "token's query heads open their own either way",
        choices=ROUTINGS,
    )
    leaf_budget: int = setting(
        1024,
        "retrieval methods, block routing: the most leaves per KV head a prefill chunk's "
        "queries open together (0: no bound, every unit)",
    )
    positions: str = setting(
        "exact",
        "retrieval methods (two-level kvm-fold, quest, infllm): where they place the tokens: "
        "exact (each at the position the model gave it; refused past the model's positions) or "
        "inside (what left the window un-rotated and met at one distance, window - 1; the sinks "
        "and window at their cache index: no distance past the budget, at any length)",
        choices=POSITIONS,
    )
    quest_page: int = mirror(QuestConfig, "page", "quest: ")
    quest_open: int = mirror(QuestConfig, "open", "quest: ")
    quest_dense_layers: int = mirror(QuestConfig, "dense_layers", "quest: ")
    infllm_block: int = mirror(InfLLMConfig, "block", "infllm: ")
    infllm_representatives: int = mirror(InfLLMConfig, "representatives", "infllm: ")
    infllm_open: int = mirror(InfLLMConfig, "open", "infllm: ")
    only: tuple[str, ...] = setting(
        (),
        "run only these of the runs the other options make, by label (full, streaming@1024, "
        "kvm-fold/fixed/open8/int8@1024, ...; default: all of them)",
    )

    def bounded_configs(self, methods: tuple[str, ...]) -> dict[str, BoundedConfig]:
        """The config of every bounded run of `methods`, by label; a bad option is refused,
        also where a config refuses the value the option feeds it."""
        require_at_least(1, self, "budgets", "stream_chunk")
        require_at_least(0, self, "sinks", "leaf_budget")
        require(
            self.window is None or self.window >= 1,
            self,
            "window",
            f"must be >= 1 (or unset: half the budget), got {self.window}",
        )
        made: list[tuple[str, BoundedConfig]] = []  # (method, config), labelled below
        for budget in self.budgets:
            if "streaming" in methods:
                require(
                    budget > self.sinks,
                    self, "budgets",
                    f"{budget} leaves no window for streaming beside {self.sinks} sinks",
                )  # fmt: skip
                made.append(("streaming", BoundedConfig(
                    budget=budget, sinks=self.sinks, window=budget - self.sinks
                )))  # fmt: skip
            if "snapkv" in methods:
                made.append(
                    ("snapkv", SnapKVConfig(budget=budget, sinks=self.sinks, window=self.window))
                )
            if "quest" in methods:
                made.append(("quest", QuestConfig(
                    budget=budget, sinks=self.sinks, window=self.window, page=self.quest_page,
                    open=self.quest_open, routing=self.routing,
                    leaf_budget=self.leaf_budget or None, dense_layers=self.quest_dense_layers,
                    positions=self.positions,
                )))  # fmt: skip
            if "infllm" in methods:
                made.append(("infllm", InfLLMConfig(
                    budget=budget, sinks=self.sinks, window=self.window, block=self.infllm_block,
                    representatives=self.infllm_representatives, open=self.infllm_open,
                    positions=self.positions,
                )))  # fmt: skip
            for state in self.kvm_states if "kvm-fold" in methods else ():
                for k in self.kvm_open:
                    for leaves in self.kvm_leaves if k else ("exact",):  # coarse: no leaves
                        made.append(("kvm-fold", KVMFoldConfig(
                            budget=budget, sinks=self.sinks, window=self.window, state=state,
                            growth_factor=self.kvm_growth_factor, readout=self.kvm_readout,
                            count_bias=self.kvm_count_bias,
                            merge_threshold=self.kvm_merge_threshold,
                            slot_cap=self.kvm_slot_cap, open=k, leaves=leaves,
                            leaf_dir=self.kvm_leaf_dir, lod_factor=self.kvm_lod_factor,
                            lod_floor=self.kvm_lod_floor, routing=self.routing,
                            leaf_budget=self.leaf_budget or None,
                            slot_key=self.kvm_slot_key if k else "rotated",  # coarse: not read
                            slot_score=self.kvm_slot_score if k else "mean",
                            slot_variance=self.kvm_slot_variance if k else 0.0,
                            rerank=self.kvm_rerank if k else 0,
                            readouts=self.kvm_readouts or not k,
                            positions=self.positions if k else "exact",
                        )))  # fmt: skip
        configs = {config_label(method, config): config for method, config in made}
        known = [m for m in methods if m not in BOUNDED] + list(configs)
        unknown = [label for label in self.only if label not in known]
        require(
            not unknown, self, "only",
            f"{unknown} are not runs of these options, which make {known}",
        )  # fmt: skip
        if self.only:
            configs = {label: c for label, c in configs.items() if label in self.only}
        for label, config in configs.items():
            require(
                self.stream_chunk <= config.window_len,
                self,
                "stream_chunk",
                f"{self.stream_chunk} exceeds the window of {label} ({config.window_len} tokens)",
            )
        return configs

    def check_runs(
        self, model: nn.Module, methods: tuple[str, ...], field: str = "methods"
    ) -> dict[str, BoundedConfig]:
        """`bounded_configs`, after a SettingError unless every bounded run fits the model: its
        budget within the model's positions (on `budgets`), the model one a bounded cache can
        run (on `field`, the setting that names the methods)."""
        configs = self.bounded_configs(methods)
        for label, config in configs.items():
            with refused_as(self, "budgets", f"{label}: {{}}"):
                check_budget(model, config.budget)
            cannot = (
                f"{method_of(label)} cannot run on this model ({{}}); read it with full or fold"
            )
            with refused_as(self, field, cannot):
                check_bounded(model, config.budget, label)
        return configs

    def labels(self, methods: tuple[str, ...]) -> list[str]:
        """Every run of `methods` in order: full and fold by name, bounded ones by label."""
        bounded = self.bounded_configs(methods)
        out: list[str] = []
        for method in methods:
            if method in BOUNDED:
                out += [label for label in bounded if method_of(label) == method]
            elif not self.only or method in self.only:
                out.append(method)
        return out


def two_level_tag(config: KVMFoldConfig) -> str:
    """The label part of a kvm-fold run by what it opens: "" (coarse), "/open8", with the options
    that differ from the default after it: "/open8/int8/centred/box/inside", "/open8/var1",
    "/open8/token" (every query routes on its own)."""
    if not config.open:
        return ""
    options = [config.leaves] if config.leaves != "exact" else []
    options += [config.slot_key] if config.slot_key != "rotated" else []
    options += [config.slot_score] if config.slot_score != "mean" else []
    options += [f"var{config.slot_variance:g}"] if config.slot_variance else []
    options += [f"rerank{config.rerank}"] if config.rerank else []
    options += [] if config.readouts else ["noreadouts"]
    options += [config.routing] if config.routing != "block" else []
    options += [config.positions] if config.positions != "exact" else []
    return "/".join(["", f"open{config.open}", *options])


def config_label(method: str, config: BoundedConfig) -> str:
    """A run's label from its config, as `BoundedOptions` labels the runs it makes:
    "streaming@1024", "kvm-fold/sqrt/open8/int8@1024", "kvm-fold/fixed/cap4@1024" (slots
    bounded); a retrieval run placing positions inside or routing every query on its own says
    so ("quest/inside@1024", "quest/token@1024")."""
    if isinstance(config, KVMFoldConfig):
        cap = "" if config.slot_cap is None else f"/cap{config.slot_cap:g}"
        return f"kvm-fold/{config.state}{cap}{two_level_tag(config)}@{config.budget}"
    inside = "/inside" if places_inside(config) else ""
    token = "/token" if isinstance(config, QuestConfig) and config.routing == "token" else ""
    return f"{method}{inside}{token}@{config.budget}"


def split_label(label: str) -> tuple[str, int | None]:
    """("kvm-fold/sqrt", 1024) from "kvm-fold/sqrt@1024"; ("full", None) from "full"."""
    name, _, budget = label.partition("@")
    return name, int(budget) if budget else None


def method_of(label: str) -> str:
    """The method of a run: "kvm-fold" from "kvm-fold/sqrt@1024", "full" from "full"."""
    return split_label(label)[0].split("/")[0]


def reader_of(label: str) -> str:
    """Whose options a run reads: "two-level" for a kvm-fold run that opens slots
    ("kvm-fold/fixed/open8@1024"), else its method (`method_of`)."""
    method = method_of(label)
    return "two-level" if method == "kvm-fold" and "/open" in label else method


def runner_class(config: BoundedConfig) -> type[BoundedRunner]:
    """The runner class of a bounded config: its class says which method."""
    if isinstance(config, KVMFoldConfig):
        return TwoLevelRunner if config.open else KVMFoldRunner
    for kind, runner in ((SnapKVConfig, SnapKVRunner), (QuestConfig, QuestRunner),
                         (InfLLMConfig, InfLLMRunner)):  # fmt: skip
        if isinstance(config, kind):
            return runner
    return StreamingRunner


def keeps_positions(config: BoundedConfig) -> bool:
    """Whether a run of this config keeps every token at its own position (a retrieval
    cache: two-level KVM-Fold, Quest, InfLLM, with positions exact), so that the model must have
    positions for the whole input, where the other bounded caches place theirs inside the
    budget."""
    return issubclass(runner_class(config), RetrievalRunner) and not places_inside(config)


def make_runner(model: nn.Module, config: BoundedConfig, track: bool = False) -> BoundedRunner:
    """A fresh runner of a bounded config (`runner_class`); track: a KVM-Fold runner keeps
    where each leaving token went."""
    runner = runner_class(config)
    if issubclass(runner, KVMFoldRunner):
        return runner(model, config, track)
    if runner is StreamingRunner:
        return StreamingRunner(model, config.sinks, config.window_len)
    return runner(model, config)


def run_bounded(
    model: nn.Module,
    input_ids: Tensor,
    config: BoundedConfig,
    chunk_size: int | None = None,
    *,
    return_logits: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Read input_ids (B, T) in chunks of chunk_size (None: STREAM_CHUNK, 64 tokens, at most the
    window; see it for the measurement) through a fresh cache of a bounded config
    (`make_runner`); nll and logits as for `kv_fold`."""
    runner = make_runner(model, config)
    return bounded_fold(
        runner, input_ids, chunk_size, return_logits=return_logits, progress=progress
    )


def read_and_answer(
    model: nn.Module,
    ids: Tensor,
    method: str,
    max_new_tokens: int,
    *,
    runner: BoundedRunner | None = None,
    chunk_size: int = FOLD_CHUNK,
    variant: str = "exact",
    stream_chunk: int | None = None,
    eos_token_id: int | None = None,
    allow_extrapolation: bool = False,
    pick: Pick = greedy,
    on_token: Callable[[Tensor], object] | None = None,
    after_prompt: Callable[[], object] | None = None,
) -> Tensor:
    """Read a prompt ids (B, T) by one method and decode (B, n) from what it keeps: `full` (one
    forward), `fold` (chunks of chunk_size, `variant`) or a bounded method through `runner`
    (`make_runner`; chunks of stream_chunk, None: STREAM_CHUNK at most the window; after_prompt
    is called once the prompt is read).
    Decoding is greedy unless `pick` samples; on_token sees each step's tokens as they come;
    a chunked read shows its progress, labelled by `method` (a run's label)."""
    if method in ("full", "fold"):
        size, variant = (ids.shape[1], "exact") if method == "full" else (chunk_size, variant)
        return fold_generate(
            model, ids, size, max_new_tokens, eos_token_id=eos_token_id,
            allow_extrapolation=allow_extrapolation, variant=variant,
            progress=method == "fold", pick=pick, on_token=on_token,
        )  # fmt: skip
    if runner is None:
        raise ValueError(f"runner: {method} reads through a bounded runner; pass make_runner's")
    return bounded_generate(
        runner, ids, stream_chunk, max_new_tokens, eos_token_id=eos_token_id, progress=True,
        after_prompt=after_prompt, pick=pick, on_token=on_token, desc=method,
    )  # fmt: skip


def describe_runs(configs: dict[str, BoundedConfig]) -> str:
    """One phrase per bounded run: its label and how it splits its budget."""
    return "; ".join(f"{label}: {config.describe()}" for label, config in configs.items())


def split_cells(config: BoundedConfig) -> list[str]:
    """How a bounded run splits what a query attends: its sinks, its exact window, its middle
    (read-outs or kept tokens, "-" for none) and the most leaves it opens exactly beside them
    ("-" for none), and the most exact entries a query attends (sinks + window + leaves)."""
    middle = "-"
    opened: int | None = 0
    if isinstance(config, KVMFoldConfig):
        middle = f"{config.middle_len} slots"
        if config.open:
            opened = config.leaf_budget
    elif isinstance(config, SnapKVConfig):
        middle = f"{config.middle_len} kept"
    elif isinstance(config, QuestConfig):
        opened = None if config.leaf_budget is None else max(
            config.leaf_budget, config.open * config.page
        )  # fmt: skip
    elif isinstance(config, InfLLMConfig):
        opened = config.open * config.block
    if opened is None:  # no bound: every leaf
        return [str(config.sinks), str(config.window_len), middle, "all", "all"]
    exact = config.sinks + config.window_len + opened
    leaves = str(opened) if opened else "-"
    return [str(config.sinks), str(config.window_len), middle, leaves, str(exact)]


SPLIT_HEADER = ["sinks", "window", "middle", "leaves opened", "exact entries"]


def split_table(configs: dict[str, BoundedConfig]) -> list[str]:
    """Markdown: per bounded run, how it splits what a query attends (`split_cells`)."""
    rows = [[label, *split_cells(config)] for label, config in configs.items()]
    return markdown_table(["run", *SPLIT_HEADER], rows, "<" + ">" * len(SPLIT_HEADER))
