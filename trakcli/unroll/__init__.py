"""Unrolled data attribution: metagradients through a recorded training (``score.method: unroll``).

For the models `trak optimize` trains with ``optimize.replay: true`` (:mod:`trakcli.train.replay`), the score of train
example i for target z is ``−∂ℓ_z(θ_T)/∂w_i``: minus the derivative of the target's loss at the final weights with
respect to the weight of example i's loss in every step it was in (w = 1 in the recorded run), by reverse mode through
the optimizer's steps (Ilyas & Engstrom 2025, "MAGIC: Near-Optimal Data Attribution for Deep Learning"). Positive:
upweighting the example lowers the target's loss (trakcli's sign convention). :class:`ReplayRecord` reads a record and
walks its steps, :func:`update` is an optimizer step as a differentiable function, :func:`replay` reruns the training
bit for bit and :class:`Unroller` gives metagradients.
"""

from trakcli.unroll.metagrad import Unroller, check_model, replay
from trakcli.unroll.record import ReplayRecord, Step, check_recipe_supported, no_record
from trakcli.unroll.steps import Hyper, initial_state, update

__all__ = ["Hyper", "ReplayRecord", "Step", "Unroller", "check_model", "check_recipe_supported", "initial_state",
           "no_record", "replay", "update"]
