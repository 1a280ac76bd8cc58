"""Which answers in an earlier niah result file (`NiahRun.save`) a run may take instead of
answering: all of them from a file of the same settings (an interrupted grid), or those of its
own method runs and cells from a file whose other settings these runs do not read (a grid split
over processes, or grown by more samples, lengths or runs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from longkv.caches.methods import BOUNDED, BoundedOptions, method_of
from longkv.checks import require
from longkv.evals.niah_records import NiahRecord, NiahSettings


def saved_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The settings of a niah result file (`NiahRun.save`), with the default of any setting
    added after the file was written."""
    defaults = {f.name: f.default for f in fields(NiahSettings)}
    return {**json.loads(json.dumps(defaults)), **data.get("settings", {})}


def saved_records(path: Path, settings: NiahSettings) -> list[NiahRecord]:
    """Records of an earlier run with the same settings at path (none if it differs)."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if saved_settings(data) != json.loads(json.dumps(asdict(settings))):
        return []
    return [NiahRecord(**r) for r in data["records"]]


# the settings that choose which runs (by label) and cells (task, length, depth, seed) a file
# answered, and where file leaves go; the others must agree for answers to be reused
RUN_FIELDS = (
    "methods", "budgets", "kvm_states", "kvm_open", "kvm_leaves", "kvm_slot_key", "kvm_leaf_dir",
    "only",
)  # fmt: skip
GRID_FIELDS = ("tasks", "lengths", "depths", "samples", "seed")
# settings that only some methods read: a difference in one keeps the other methods' answers
ONLY_FOR = {
    "chunk_size": ("fold",),
    "variant": ("fold",),
    "sinks": BOUNDED,
    "stream_chunk": BOUNDED,
    "window": ("snapkv", "kvm-fold"),
    **{f.name: ("kvm-fold",) for f in fields(BoundedOptions) if f.name.startswith("kvm_")},
}


def reusable_records(path: Path, s: NiahSettings) -> tuple[list[NiahRecord], dict[str, Any]]:
    """The answers in a niah result file (`NiahRun.save`) to runs and cells of this grid, and
    the file's provenance; a SettingError if an option that one of its runs here reads
    (`ONLY_FOR`), or one that every answer reads, differs from these."""
    data = json.loads(path.read_text())
    ours = json.loads(json.dumps(asdict(s)))
    theirs = saved_settings(data)
    runs = set(s.runs)
    cells = set(s.cells)
    records = [
        record
        for record in (NiahRecord(**r) for r in data["records"])
        if record.method in runs and record.key[:4] in cells
    ]
    methods = {method_of(r.method) for r in records}
    differ = sorted(
        k
        for k in ours
        if k not in RUN_FIELDS + GRID_FIELDS
        and theirs[k] != ours[k]
        and (k not in ONLY_FOR or methods & set(ONLY_FOR[k]))
    )
    require(
        not differ,
        NiahSettings,
        "methods",
        f"{path} answered another grid or other method options ({differ} differ); its answers "
        "cannot be reused",
    )
    return records, data.get("provenance", {})


def reused_answers(paths: tuple[str, ...], s: NiahSettings) -> tuple[list[NiahRecord], list[str]]:
    """The answers of every file in paths that this grid may take (`reusable_records`), one per
    run and cell (the first file's, where several files answered it), and a page line per file
    naming how many it gave and the command that gave them."""
    records: list[NiahRecord] = []
    lines: list[str] = []
    for path in paths:
        found, source = reusable_records(Path(path), s)
        known = {r.key for r in records}
        taken = [r for r in found if r.key not in known]
        records += taken
        lines.append(
            f"- {len(taken)} needle answers from `{source.get('command')}` "
            f"(commit `{source.get('commit')}`)"
        )
    return records, lines
