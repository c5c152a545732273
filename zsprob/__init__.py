"""zsprob: probabilistic image-text embeddings.

Every input maps to a diagonal Gaussian N(mu, sigma^2), stored as a pair of tensors
``(mu, logvar)`` of shape [N, D] with ``logvar = log sigma^2``. The package follows the
data flow of DESIGN.md::

    zsprob.prob       tensor math on Gaussians: distances, losses, MSDA
    zsprob.models     open_clip towers with mu / log sigma^2 heads, checkpoints
    zsprob.data       SynthWorld, WebDataset shards (RedCaps), COCO, ImageNet / folders
    zsprob.train      one accelerate training loop for pretraining and fine-tuning
    zsprob.zeroshot   prompt banks, uncertainty-based prompt selection, classification
    zsprob.retrieval  retrieval metrics (COCO, CxC, ECCV Caption, PMRP), exact CSD search
    zsprob.report     plots and the demo report

Sub-packages are imported lazily so that ``import zsprob`` stays cheap. This module owns the
version and :class:`UserError`, and imports ``zsprob.errors`` only. Beside the packages,
``zsprob.methods`` reads the names of the training methods and prompt strategies from their
registries (``zsprob.prob.method_registry``, ``zsprob.zeroshot.strategy_registry``),
``zsprob.config`` the YAML configs and ``zsprob.errors`` the user-error type.
"""
from zsprob.errors import UserError

__version__ = "0.1.0"

__all__ = ["UserError", "__version__"]
