"""``oar plan``'s text: the settings, the training and engine tables, the per-phase totals and the
verdict of a :class:`~oar.plan.terms.PlanResult`."""

from __future__ import annotations

from oar.plan.terms import MEMORY_PHASES, PlanResult, gib

__all__ = ["format_plan"]


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(r) for r in rows]


def format_plan(result: PlanResult, *, source: str = "", footer: list[str] | None = None) -> str:
    """The plan as text: settings, a training table, an engine table, per-phase totals, the verdict;
    then the lines of ``footer`` (what the caller adds, e.g. the checkpoint size and SLURM's signal)."""
    s = result.settings
    shape = result.shape
    out = [f"oar plan{(' ' + source) if source else ''}: {shape.origin}", f"  {shape.describe()}",
           f"  {result.world_size} process(es) x {s.gpu_gb:.3g} GiB{'' if s.on_gpu else ' host memory'} "
           f"({s.memory_source}), "
           f"train.strategy {s.strategy}, compute "
           f"{s.compute}, master {s.master if s.master == 'float32' else s.model_dtype}, gradient "
           f"checkpointing {'on' if s.checkpointing else 'off'}"
           + (", fsdp cpu_offload" if s.cpu_offload else ""),
           f"  micro-batch {s.micro} sequences x {s.seq} tokens ({s.prompt} prompt (plan.prompt_tokens) + "
           f"{s.response} response), rollout.engine {s.engine}"
           + (", sleep_mode" if s.sleep_mode else "")
           + ("" if result.padded else ", no padding"),
           f"  largest forward: {s.batch.describe()} (train.packing, train.micro_batch_tokens), "
           f"{s.micro_batches} per mini-batch", ""]
    rows = []
    for t in [*result.terms, *result.credit]:
        short = {"forward": "fwd", "backward": "bwd", "backward end": "bwd-end"}
        ph = "all" if set(t.phases) == set(MEMORY_PHASES) else " ".join(short.get(p, p) for p in t.phases)
        cpu = f" [{gib(t.cpu_bytes)} GiB CPU]" if t.cpu_bytes else ""
        rows.append([t.name, gib(t.bytes), ph, t.note + cpu])
    out += _table(rows, [f"training, {s.per}", "GiB", "phases", "what"], {1})
    if result.engine:
        out.append("")
        rows = [[t.name, gib(t.bytes), t.note] for t in result.engine]
        out += _table(rows, [f"vLLM engine, {s.per}", "GiB", "what"], {1})
    out.append("")
    share = next((t for t in result.engine if t.name == "vLLM share"), None)
    rows = []
    for ph in MEMORY_PHASES:
        with_engine = share is not None and result.engine_in(ph)
        parts = gib(result.phase_totals[ph] - result.headroom_bytes - (share.bytes if with_engine else 0))
        extra = f" + vLLM {gib(share.bytes)}" if with_engine else ""
        mark = "  <- peak" if ph == result.peak_phase else ""
        rows.append([ph, gib(result.phase_totals[ph]), f"training {parts}{extra} + headroom "
                     f"{gib(result.headroom_bytes)}{mark}"])
    out += _table(rows, ["phase", "GiB", "sum"], {1})
    out.append("")
    verdict = "fits" if result.fits else "DOES NOT FIT"
    limit = f"{s.gpu_gb:.3g} GiB per GPU" if s.on_gpu else f"{s.gpu_gb:.3g} GiB host memory per process"
    out.append(f"peak {gib(result.peak_bytes)} GiB of {limit}: {verdict}")
    if not result.fits:
        out.append(result.message)
    for t in result.credit:
        out.append(f"credit phase with the {t.name[len('credit: '):]}: {gib(result.credit_totals[t.name])} GiB "
                   f"{s.per} ({gib(t.bytes)} GiB for the pass: {t.note})")
    out += footer or []
    return "\n".join(out) + "\n"
