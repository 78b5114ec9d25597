"""Exact replay of a recorded training, and its metagradients by reverse mode through the steps.

Notation. Step t (1..T) of the recorded training minimizes the batch loss ``L_t(θ, w) = Σ_{i∈B_t} w_i ℓ_i(θ) / c_t``
(``ℓ_i`` the example's training loss summed over its terms, :func:`trakcli.tasks.example_losses`; ``c_t`` the batch's
:meth:`~trakcli.tasks.Task.loss_count`, so ``w = 1`` is the recorded loss), then updates the state
``S_t = (θ_t, optimizer state)`` by :func:`trakcli.unroll.steps.update`. For a target z the metagradient is
``∂ℓ_z(θ_T) / ∂w_i``: how the target's loss at the final weights moves per unit of extra weight on example i's loss in
every step it is in (Ilyas & Engstrom 2025, "MAGIC: Near-Optimal Data Attribution for Deep Learning"). Reverse mode:
``a_T = (∇_θ ℓ_z(θ_T), 0)``; for t = T..1, ``(a_{t-1}, ∂/∂w_{B_t}) = vjp(S_{t-1} ↦ S_t)(a_t)`` (a Hessian-vector product
inside each step, from ``torch.func.vjp`` of a step that calls ``torch.func.grad``).

Memory and time. The states stored every ``every`` steps (:mod:`trakcli.train.replay`) are read back one segment at a
time, latest first: the segment's states are recomputed forward from its stored state (held in memory:
``every × (parameters + optimizer state)`` floats), then its steps are reversed. ``k`` targets share one replay: the
adjoints are stacked ``[k, ...]`` and each step's vector-Jacobian product is ``vmap``-ed over them. One replay costs one
forward-recomputed training (forward + backward per step) plus, per step, one more forward + backward and k
double-backward passes (batched): about ``2 + c·k`` trainings with c ≈ 1-3 on a CPU, measured in docs/guides/unroll.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from trakcli.errors import ArgumentError, ConfigError
from trakcli.models.forward import logits_of, model_kwargs
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.tasks import Task, example_losses, make_batch
from trakcli.train.optimizers import make_optimizer
from trakcli.train.replay import rng_states, set_rng_states
from trakcli.train.rows import TrainRows
from trakcli.unroll.record import ReplayRecord, check_recipe_supported
from trakcli.unroll.steps import Hyper, initial_state, update

Tensors = dict[str, torch.Tensor]


def differentiable_attention() -> Any:
    """A context in which ``F.scaled_dot_product_attention`` runs its math kernel: the fused kernels torch picks
    by default have no derivative of their backward, which the double-backward of a step through a transformer
    needs; the math kernel computes the same attention (to float32 rounding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def check_model(model: nn.Module, what: str) -> None:
    """Refuse a model whose training :mod:`trakcli.unroll` cannot differentiate.

    Raises:
        ConfigError: a module that updates buffers while training (batch norm running statistics,
            named), or a parameter that is not float32.
    """
    for name, mod in model.named_modules():
        if getattr(mod, "track_running_stats", False) and getattr(mod, "running_mean", None) is not None:
            raise ConfigError(f"{what}: module {name!r} ({type(mod).__name__}) updates running statistics while "
                              "training, which score.method: unroll does not differentiate; use a model without batch "
                              "norm (LayerNorm / GroupNorm), or track_running_stats=False")
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(f"{what}: parameter {name!r} is {str(p.dtype).replace('torch.', '')}: score.method: "
                              "unroll replays and differentiates float32 training only (bfloat16 / float16 "
                              "training is refused); train the model in float32")


def replay(model: nn.Module, data: TrainRows, record: ReplayRecord, task: Task, *, start: int = 0) -> nn.Module:
    """Rerun the recorded training from its stored state after ``start`` steps to the end, as it ran.

    The model is loaded with the stored state and trained by the same ``torch.optim`` optimizer (loaded with its stored
    state), the same batches and learning rates and the same global RNG state, with deterministic algorithms: on the
    machine that trained it the result equals the recorded training's final weights bit for bit.

    Args:
        model: the model built like the trained one (``model.entrypoint``), on the training device.
        data: the rows it was trained on (in the recorded row numbering).
        record: its replay record; start: a step in ``record.states``.

    Returns:
        The same model, trained, in eval mode.

    Raises:
        CheckpointError: a record file is missing or does not match the rows.
    """
    from trakcli.models.forward import forward

    r = record.recipe
    snap = record.state(start)
    model.load_state_dict(snap["model"])
    device = next(iter(model.parameters())).device
    opt = make_optimizer(r["optimizer"], [p for p in model.parameters() if p.requires_grad], lr=r["lr"],
                         momentum=r["momentum"], weight_decay=r["weight_decay"], projection=r.get("projection"))
    opt.load_state_dict(snap["optimizer"])
    set_rng_states(snap["rng"], device)
    import torch.utils.deterministic as det

    deterministic, fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False  # as the recorded training ran
    model.train()
    try:
        for step in record.steps(data, snap):
            for group in opt.param_groups:
                group["lr"] = step.lr
            opt.zero_grad(set_to_none=True)
            logits = forward(model, step.inputs)
            task.loss(logits, make_batch(step.inputs, step.labels)).backward()
            opt.step()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        det.fill_uninitialized_memory = fill
    return model.eval()


class Unroller:
    """Metagradients of target losses with respect to the weights of a recorded training's examples.

    Args:
        model: the model built like the trained one, on ``device`` (its weights are replaced).
        data: the rows it was trained on (in the recorded numbering), batches on ``device``.
        record: the training's replay record.
        task: the task whose loss was trained (and is the targets' loss).

    Raises:
        ConfigError: a recipe or model the steps cannot be differentiated through (named:
            :func:`~trakcli.unroll.record.check_recipe_supported`, :func:`check_model`), or a task whose
            training loss is not the mean of its example losses.
    """

    def __init__(self, model: nn.Module, data: TrainRows, record: ReplayRecord, task: Task):
        check_recipe_supported(record)
        check_model(model, record.what)
        self.model, self.data, self.record, self.task = model, data, record, task
        self.device = next(iter(model.parameters())).device
        snap = record.state(0)
        model.load_state_dict(snap["model"])
        self.names = [k for k, p in model.named_parameters() if p.requires_grad]
        recorded = [p["name"] for p in record.meta["params"]]
        if recorded != self.names:
            raise ConfigError(f"{record.what}: the model's trainable parameters differ from the recorded training's "
                              "(model.entrypoint or model.kwargs changed); score with the model it was trained as")
        groups = snap["optimizer"].get("param_groups", [])
        if len(groups) != 1:
            raise ConfigError(f"{record.what}: the optimizer had {len(groups)} parameter groups; score.method: "
                              "unroll differentiates one")
        self.hyper = Hyper.of(record.recipe["optimizer"], groups[0])
        # the buffers and frozen parameters; a key tied to a trainable parameter (GPT-2's lm_head.weight is
        # transformer.wte.weight) is left out: functional_call sets it through the trainable name
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        self.fixed = {k: v for k, v in model.state_dict(keep_vars=True).items()
                      if k not in set(self.names) and id(v) not in trainable}
        self.vmapped = True
        self._checked = False

    # -- the functions differentiated ------------------------------------------------------------------------

    def _logits(self, params: Tensors, x: Any) -> torch.Tensor:
        tensors = {**self.fixed, **params}
        if isinstance(x, dict):
            return logits_of(torch.func.functional_call(self.model, tensors, (), model_kwargs(self.model, x)))
        return torch.func.functional_call(self.model, tensors, (x,))

    def _batch_loss(self, params: Tensors, w: torch.Tensor, x: Any, y: torch.Tensor, count: int) -> torch.Tensor:
        """``Σ_i w_i ℓ_i(θ) / count``, a float scalar (nats)."""
        return (w * example_losses(self.task, self._logits(params, x), make_batch(x, y))).sum() / count

    def _step_fn(self, x: Any, y: torch.Tensor, lr: float, t: int) -> Callable[..., tuple[Tensors, dict]]:
        count = self.task.loss_count(make_batch(x, y))
        if not self._checked:
            self._check_loss(x, y, count)

        def step(params: Tensors, state: dict, w: torch.Tensor) -> tuple[Tensors, dict]:
            grads = torch.func.grad(self._batch_loss)(params, w, x, y, count)
            return update(self.hyper, params, state, grads, lr, t)
        return step

    def _check_loss(self, x: Any, y: torch.Tensor, count: int) -> None:
        """Refuse a task whose training loss is not ``Σ_i ℓ_i / count`` (checked on the first batch)."""
        self._checked = True
        params = {k: v.detach() for k, v in self.model.named_parameters() if k in set(self.names)}
        with torch.no_grad():
            logits = self._logits(params, x)
            batch = make_batch(x, y)
            mine = float((example_losses(self.task, logits, batch)).sum() / count)
            theirs = float(self.task.loss(logits, batch))
        if abs(mine - theirs) > 1e-4 * max(1.0, abs(theirs)):
            raise ConfigError(f"task {self.task.name!r}: its training loss ({theirs:.6g} on the first batch) is not "
                              f"the mean of its example losses ({mine:.6g}), which score.method: unroll weights; give "
                              "the task an example_loss(logits, batch) -> [n] whose mean is its loss")

    # -- forward and reverse -----------------------------------------------------------------------------------

    def _load(self, step: int) -> tuple[Tensors, dict, int, dict[str, Any]]:
        snap = self.record.state(step)
        sd = snap["model"]
        params = {k: sd[k].to(self.device).detach() for k in self.names}
        state, count = initial_state(self.hyper, params, snap["optimizer"], self.names)
        if self.hyper.kind != "sgd" and count != step:
            count = step  # every parameter steps on every step: the bias corrections' t
        return params, state, count, snap

    def _run(self, start: int, stop: int | None = None, weights: torch.Tensor | None = None,
             saved: list | None = None) -> tuple[Tensors, dict]:
        """The parameters and optimizer state after step ``stop`` (default: the last), recomputed by the functional
        steps (train mode) from the stored state after ``start``; example i's loss times ``weights[i]`` (None: 1);
        before each step, ``(step, params, state, count, RNG states)`` appended to ``saved``."""
        params, state, count, snap = self._load(start)
        set_rng_states(snap["rng"], self.device)
        self.model.train()
        for step in self.record.steps(self.data, snap, stop):
            if saved is not None:
                saved.append((step, params, state, count, rng_states(self.device)))
            if weights is None:
                w = torch.ones(len(step.rows), device=self.device)
            else:
                w = weights[step.rows.to(self.device)]
            new_p, new_s = self._step_fn(step.inputs, step.labels, step.lr, count + 1)(params, state, w)
            params = {k: v.detach() for k, v in new_p.items()}
            state = {name: {k: v.detach() for k, v in part.items()} for name, part in new_s.items()}
            count += 1
        return params, state

    def final_params(self) -> Tensors:
        """The weights after the last step, recomputed by the functional steps from the last stored state."""
        return self._run(*self.record.segments()[-1])[0]

    def reweighted_params(self, weights: torch.Tensor) -> Tensors:
        """The final weights of the recorded training rerun with example weights ``weights`` from its first state.

        Every step keeps its batch, learning rate and loss count ``c_t`` (module docstring); example i's loss
        is multiplied by ``weights[i]``. ``weights`` 0 on a set of rows is the counterfactual the
        metagradients linearize (MAGIC's same-seed retraining: the same initialization and order, those
        rows dropped from their batches); all ones recomputes the recorded run.

        Args:
            weights: ``[n]`` float (the trained rows, in the recorded numbering), on any device.

        Returns:
            ``{name: tensor}`` of the trainable parameters, float32, on the device.

        Raises:
            ArgumentError: ``weights`` is not ``[n]``.
        """
        if tuple(weights.shape) != (self.data.n,):
            raise ArgumentError(f"weights of shape {list(weights.shape)}: give one weight per trained row, "
                                f"[{self.data.n}]")
        params = self._run(0, weights=weights.to(self.device, torch.float32))[0]
        self.model.eval()
        return params

    def target_grads(self, params: Tensors, inputs: Any, labels: torch.Tensor) -> Tensors:
        """``∇_θ ℓ_z(θ)`` of each target z (eval mode): ``{name: [k, *shape]}`` float32.

        Args:
            inputs: ``[k, ...]`` (or a dict of ``[k, L]`` tensors); labels: ``[k]`` or ``[k, L]``.
        """
        self.model.eval()
        k = int(labels.shape[0])
        rows = []
        for j in range(k):
            x = {n: v[j:j + 1] for n, v in inputs.items()} if isinstance(inputs, dict) else inputs[j:j + 1]
            loss = lambda p: example_losses(self.task, self._logits(p, x), make_batch(x, labels[j:j + 1])).sum()  # noqa: E731
            rows.append(torch.func.grad(loss)(params))
        self.model.train()
        return {n: torch.stack([r[n] for r in rows]) for n in self.names}

    def _vjp(self, vjp_fn: Callable, adj: tuple) -> tuple:
        """``vjp_fn`` of each stacked cotangent: ``vmap`` over the targets, or one at a time where vmap fails."""
        if self.vmapped:
            try:
                return torch.func.vmap(vjp_fn)(adj)
            except Exception:  # noqa: BLE001 - an op without a batching rule: the loop computes the same
                self.vmapped = False
        k = next(iter(adj[0].values())).shape[0]
        outs = [vjp_fn(torch.utils._pytree.tree_map(lambda a: a[j], adj)) for j in range(k)]
        return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *outs)

    def metagradients(self, inputs: Any, labels: torch.Tensor, reporter: Reporter = NULL_REPORTER,
                      description: str = "unroll") -> torch.Tensor:
        """``∂ℓ_z(θ_T)/∂w_i`` for every target z and trained row i (see the module docstring).

        Args:
            inputs, labels: the k targets (as :meth:`target_grads`), on the device.
            reporter, description: one progress step per reversed training step.

        Returns:
            ``[k, n]`` float32 on the device (``n``: the trained rows, in the recorded numbering); a row never in a
            batch has 0.

        Raises:
            CheckpointError: a record file is missing or unreadable.
        """
        k = int(labels.shape[0])
        out = torch.zeros(k, self.data.n, device=self.device)
        adj: tuple | None = None
        segments = self.record.segments()
        with reporter.task(description, self.record.total_steps) as bar:
            for start, stop in reversed(segments):
                saved: list = []
                params, state = self._run(start, stop, saved=saved)  # the segment's states, forward
                if adj is None:  # the final weights: the targets' adjoints
                    a_state = {name: {n: torch.zeros(k, *v.shape, device=self.device) for n, v in part.items()}
                               for name, part in state.items()}
                    adj = (self.target_grads(params, inputs, labels), a_state)
                for step, p, st, c, rng in reversed(saved):  # reverse mode through the segment
                    set_rng_states(rng, self.device)
                    w = torch.ones(len(step.rows), device=self.device)
                    with differentiable_attention():  # the step's graph is differentiated twice
                        _, vjp_fn = torch.func.vjp(self._step_fn(step.inputs, step.labels, step.lr, c + 1), p, st, w)
                        a_p, a_s, a_w = self._vjp(vjp_fn, adj)
                    out.index_add_(1, step.rows.to(self.device), a_w.detach())
                    adj = ({n: v.detach() for n, v in a_p.items()},
                           {name: {n: v.detach() for n, v in part.items()} for name, part in a_s.items()})
                    bar.advance()
                del saved
        return out
