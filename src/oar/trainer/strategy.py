"""How the policy is spread over processes and in which precision it trains (``train.strategy``).

The training loop (:mod:`oar.trainer.loop`) talks to one :class:`Strategy`; the two strategies differ only
here:

- ``ddp`` (:class:`DDPStrategy`): every process holds the whole model, its gradients and AdamW
  states; accelerate's ``Accelerator.prepare`` wraps it in DDP when several processes run.
- ``fsdp`` (:class:`FSDPStrategy`): torch FSDP2 (``fully_shard`` on every decoder layer, then on
  the root), as verl's ``fsdp2`` strategy: parameters, gradients and optimizer states are sharded
  over the processes (``train.fsdp.cpu_offload`` keeps the shards in CPU memory); a layer's full
  weights exist only while it runs. Checkpoints are sharded (``torch.distributed.checkpoint``);
  the final model is consolidated into one ``save_pretrained`` folder.

Mixed precision as the field does it: the optimizer steps float32 master weights and keeps float32
states whatever ``model.dtype`` the model was loaded in; forwards and backwards run in
``train.compute_dtype`` (FSDP's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``,
``torch.autocast`` under ddp). Stepping weights in a low precision (``train.master_dtype: model``)
happens only when a config asks for it by name.

Phases of rank-local work whose number of forwards differs between processes (the rollout's
``generate``, the credit estimators' forwards and OAR-G's input-gradient backward) run inside
:meth:`Strategy.local_phase`: under FSDP the whole model is gathered once for the phase
(``unshard``; nothing is resharded until it ends), so they issue no collective and cannot deadlock;
they still call the sharded module itself, never an unwrapped one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from oar.config.settings import TrainSettings
from oar.core.io import SharedWriteError, commit_path
from oar.trainer.optim import rl_param_groups

__all__ = ["Strategy", "DDPStrategy", "FSDPStrategy", "make_strategy", "shutdown", "COMPUTE_DTYPES", "SharedWriteError"]

COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Folder of the sharded model and optimizer state inside an FSDP checkpoint.
SHARDS_DIR = "shards"


class Strategy:
    """Distribution and precision of the policy. Subclasses: :class:`DDPStrategy`, :class:`FSDPStrategy`.

    Attributes:
        accelerator: the ``accelerate.Accelerator`` (process group, device, rank).
        compute_dtype: dtype of forwards/backwards.
        master_dtype: dtype of the stepped weights and optimizer states (None: the model's own).
        gradient_checkpointing: recompute layer activations in the backward.
    """

    name = "base"

    def __init__(self, accelerator: Any, train: TrainSettings) -> None:
        self.accelerator = accelerator
        self.compute_dtype = COMPUTE_DTYPES[train.compute_dtype]
        self.master_dtype = torch.float32 if train.master_dtype == "float32" else None
        self.gradient_checkpointing = train.gradient_checkpointing

    # ------------------------------------------------------------------ processes
    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the processes (the values themselves with one)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def mean_over_ranks(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return (t / self.world).tolist()

    # ------------------------------------------------------------------ model
    def _master(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast to the master dtype and switch on gradient checkpointing (before wrapping)."""
        if self.master_dtype is not None:
            model.to(self.master_dtype)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def prepare(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap/shard the policy and build AdamW over its (master) parameters."""
        raise NotImplementedError

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place a frozen model (the KL reference) like the policy, without an optimizer."""
        raise NotImplementedError

    def policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module that rollout and credit estimators call (inside :meth:`local_phase`)."""
        return model

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for the update's forwards (autocast where the strategy needs it)."""
        return contextlib.nullcontext()

    def local_phase(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context for rank-local work with a data-dependent number of forwards (see the module doc)."""
        return self.forward_context()

    def sync_context(self, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient accumulation: reduce gradients only on the micro-batch with ``sync`` True."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def full_state(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full weights, one parameter at a time (every process must iterate it)."""
        for k, v in model.state_dict().items():
            yield k, v.detach()

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def shared_atomic_dir(self, path: Path, *, seal: Callable[[Path], None] | None = None) -> Iterator[Path]:
        """A temporary folder beside ``path`` that every process may write, renamed onto ``path`` by
        the main process once all are done (:func:`oar.core.io.commit_path`).

        ``seal(tmp)`` runs on the main process after every process wrote its part and before the
        rename (it writes the checkpoint's manifest). When the block raises on any process (a full
        disk), every process learns it (a maximum over them, so none waits for the others at a
        barrier), the temporary folder is removed, the original exception is raised where it
        happened and :class:`SharedWriteError` on the other processes; ``path`` is left as it was.
        """
        path = Path(path)
        tmp = None
        if self.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        if self.world > 1:
            box = [tmp]
            torch.distributed.broadcast_object_list(box, src=0)
            tmp = box[0]
        tmp_path = Path(tmp)
        try:
            error: BaseException | None = None
            try:
                yield tmp_path
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every process knows
                error = e
            self._raise_if_any_failed(error, path)
            if self.is_main:  # after every process's part is written (the maximum above is a barrier)
                try:
                    if seal is not None:
                        seal(tmp_path)
                    commit_path(tmp_path, path)
                except BaseException as e:  # noqa: BLE001
                    error = e
            self._raise_if_any_failed(error, path)
        finally:
            if self.is_main and tmp_path.exists():
                shutil.rmtree(tmp_path, ignore_errors=True)
        self.barrier()

    def _raise_if_any_failed(self, error: BaseException | None, path: Path) -> None:
        """Raise ``error`` (or, where it is None, :class:`SharedWriteError`) on every process when
        any process has one."""
        if self.max_over_ranks([int(error is not None)])[0]:
            if error is not None:
                raise error
            raise SharedWriteError(f"{path}: another process failed writing it (its error says why); "
                                   f"{path} was left as it was")

    def checkpoint_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Bytes of the tensors a checkpoint holds (the weights, and the optimizer states when
        ``optimizer`` is given), all processes together: what writing it needs on disk, give or
        take the small files. Every process must call it (under fsdp it sums over them)."""
        def local(t: Any) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        n = sum(local(v) for v in model.state_dict().values())
        if optimizer is not None:
            n += sum(local(v) for st in optimizer.state.values() for v in st.values())
        return int(self._total_over_ranks(n))

    def _total_over_ranks(self, n: int) -> int:
        """``n`` summed over the processes that hold a share of it (only the main one's under ddp)."""
        return n

    def save_pretrained(self, model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
        """Full, consolidated weights in ``save_pretrained`` format (the main process writes)."""
        if self.is_main:
            self.accelerator.unwrap_model(model).save_pretrained(folder)
            tokenizer.save_pretrained(folder)

    def save_training_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                            tokenizer: Any) -> dict | None:
        """Write what resuming needs besides the trainer state; returns the optimizer state to store
        in ``trainer_state.pt`` (None when it is written elsewhere)."""
        self.save_pretrained(model, tokenizer, folder)
        return optimizer.state_dict()

    def resume_source(self, checkpoint: Path, start_spec: dict) -> dict:
        """The model spec to load when resuming from ``checkpoint``."""
        return dict(start_spec, source=str(checkpoint), gguf_file=None)

    def load_training_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path,
                            saved: dict) -> None:
        optimizer.load_state_dict(saved["optimizer"])


class DDPStrategy(Strategy):
    """Whole model per process; accelerate's DDP when several processes run; autocast for bf16/fp16."""

    name = "ddp"

    def prepare(self, model, *, lr, betas, weight_decay):
        model = self._master(model).to(self.device)
        optimizer = torch.optim.AdamW(rl_param_groups(model, weight_decay), lr=lr, betas=betas)
        return self.accelerator.prepare(model, optimizer)

    def prepare_frozen(self, model):
        return model.to(self.device).eval().requires_grad_(False)

    def policy(self, model):
        return self.accelerator.unwrap_model(model)

    def forward_context(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def sync_context(self, model, sync):
        return contextlib.nullcontext() if sync or self.world == 1 else self.accelerator.no_sync(model)

    def backward(self, loss):
        self.accelerator.backward(loss)

    def clip_grad_norm_(self, model, max_norm):
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_norm))

    def full_state(self, model):
        yield from super().full_state(self.policy(model))


class FSDPStrategy(Strategy):
    """torch FSDP2: ``fully_shard`` per decoder layer and on the root (see the module doc)."""

    name = "fsdp"

    def __init__(self, accelerator: Any, train: TrainSettings) -> None:
        super().__init__(accelerator, train)
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        fcfg = train.fsdp
        param_dtype = None if self.compute_dtype == torch.float32 else self.compute_dtype
        self.mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        self.cpu_offload = fcfg.cpu_offload
        self.offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        self.reshard_after_forward = fcfg.reshard_after_forward
        _ensure_process_group(accelerator)
        self._arch: str | None = None

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        self._arch = self._arch or type(model).__name__
        kw = dict(mp_policy=self.mp_policy, offload_policy=self.offload, reshard_after_forward=self.reshard_after_forward)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model

    def prepare(self, model, *, lr, betas, weight_decay):
        model = self._master(model)
        if not self.cpu_offload:  # offloaded shards stay in CPU memory
            model.to(self.device)
        model = self._shard(model)
        optimizer = torch.optim.AdamW(rl_param_groups(model, weight_decay), lr=lr, betas=betas)
        return model, optimizer

    def prepare_frozen(self, model):
        if self.master_dtype is not None:
            model.to(self.master_dtype)
        model.to(self.device).eval().requires_grad_(False)
        return self._shard(model)

    def _fsdp_modules(self, model: torch.nn.Module) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    @contextlib.contextmanager
    def local_phase(self, model):
        mods = self._fsdp_modules(model)
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in mods:
            m.unshard()
        try:
            yield
        finally:
            for m in mods:
                m.reshard()
                m.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)

    def sync_context(self, model, sync):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _total_over_ranks(self, n):
        return round(self.mean_over_ranks([float(n)])[0] * self.world)  # every process holds a shard

    def clip_grad_norm_(self, model, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state(self, model):
        for k, v in model.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v  # all-gather of this one parameter
            yield k, v.detach()

    def save_pretrained(self, model, tokenizer, folder):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            # tied weights (lm_head = embeddings) once, as save_pretrained writes them from the module
            tied = getattr(model, "all_tied_weights_keys", None) or {}
            for key in tied if getattr(model.config, "tie_word_embeddings", False) else ():
                sd.pop(key, None)
            model.save_pretrained(folder, state_dict=sd)
            tokenizer.save_pretrained(folder)
            cfg = Path(folder) / "config.json"  # fully_shard renamed the class (FSDPLlamaForCausalLM)
            data = json.loads(cfg.read_text(encoding="utf-8"))
            data["architectures"] = [self._arch]
            cfg.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    def save_training_state(self, model, optimizer, folder, tokenizer):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(Path(folder) / SHARDS_DIR))
        if self.is_main:
            tokenizer.save_pretrained(folder)
        return None

    def resume_source(self, checkpoint, start_spec):
        return dict(start_spec)  # the shards are loaded into the sharded start model

    def load_training_state(self, model, optimizer, checkpoint, saved):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(checkpoint) / SHARDS_DIR))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (the classes named in ``model._no_split_modules``, as
    transformers' own FSDP wrapping policy does); ``model.model.layers`` as a fallback."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers and hasattr(getattr(model, "model", None), "layers"):
        layers = list(model.model.layers)
    if not layers:
        raise ValueError(f"train.strategy fsdp: cannot find the decoder layers of {type(model).__name__}")
    return layers


def _ensure_process_group(accelerator: Any) -> None:
    """FSDP needs a process group even for one process: make a one-member group when none exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shutdown() -> None:
    """Destroy the process group of a multi-process run (the end of ``oar train`` under torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def make_strategy(train: TrainSettings, device: str = "cpu", *, source: str = "the config") -> Strategy:
    """The strategy ``train.strategy`` names with its accelerator (process group, device), on ``device``
    (the config's ``device`` key: ``cpu``, ``cuda`` or ``auto``). ``source`` names the config in the
    error a GPU-less node gives for ``cuda``.

    Raises:
        oar.core.problems.PreflightError: ``device`` asks for a GPU where torch sees none (never a CPU fallback).
        ValueError: ``train.compute_dtype`` float16 or ``train.fsdp.cpu_offload`` without a GPU.
    """
    from accelerate import Accelerator

    from oar.core.device import check_device

    # device: cuda where torch sees no GPU is refused, never trained on the CPU (accelerate's fallback)
    check_device({"device": device}, source=source)
    accelerator = Accelerator(cpu=device == "cpu")
    if train.compute_dtype == "float16" and accelerator.device.type == "cpu":
        raise ValueError("train.compute_dtype: float16 needs a GPU; use bfloat16 or float32 on CPU")
    if train.fsdp.cpu_offload and accelerator.device.type == "cpu":
        # FSDP2's CPUOffloadPolicy moves shards to the accelerator for compute; without one it fails
        raise ValueError("train.fsdp.cpu_offload: needs a GPU (on CPU the shards are in CPU memory already)")
    cls = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}[train.strategy]
    return cls(accelerator, train)
