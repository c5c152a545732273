"""zsprob: probabilistic image-text embeddings (PCME++, ProLIP, PCME and kin), trained and evaluated.

Every input maps to a diagonal Gaussian N(mu, sigma^2), stored as tensors ``(mu, logvar)`` of shape
[N, D] with ``logvar = log sigma^2``. The sub-packages, in the order the data flows:

    zsprob.data          SynthWorld, WebDataset shards, COCO / Flickr30K, ImageNet and folders
    zsprob.models        open_clip towers with mu / log sigma^2 heads; checkpoints, published weights
    zsprob.prob          tensor math on Gaussians: distances, losses, MSDA
    zsprob.train         one accelerate training loop for pretraining and fine-tuning
    zsprob.zeroshot      prompt banks, uncertainty-based prompt selection, classification
    zsprob.retrieval     retrieval metrics (COCO, CxC, ECCV Caption, PMRP), exact search, indexes
    zsprob.posthoc       log-variance heads for a frozen model (``zsprob posthoc``)
    zsprob.report        the demo's resumable pipeline, report and plots
    zsprob.integrations  zsprob models inside other tools (CLIP_benchmark)
    zsprob.cli           the ``zsprob`` command line
    zsprob.utils         atomic writes, JSON, devices, URLs, resource paths

Beside them: ``zsprob.config``, ``zsprob.methods`` (method and strategy names), ``zsprob.errors`` (UserError).
README.md is the manual, docs/ the method pages; sub-packages load on use, so ``import zsprob`` is cheap."""
from zsprob.errors import UserError

__version__ = "0.1.0"

__all__ = ["UserError", "__version__"]
