"""zsprob.data: everything zsprob reads, real and embedded.

Owns every reader of data and SynthWorld, the offline dataset: :mod:`~zsprob.data.webdataset`
(image-text tar shards), :mod:`~zsprob.data.coco` / :mod:`~zsprob.data.flickr` (Karpathy splits),
:mod:`~zsprob.data.classification` (ImageNet, class folders, SynthWorld's classify splits),
:mod:`~zsprob.data.masking` / :mod:`~zsprob.data.degrade` / :mod:`~zsprob.data.text_augment` (masked,
degraded and augmented copies of batches), :mod:`~zsprob.data.transforms` (PCME++'s COCO transforms)
and :mod:`~zsprob.data.synthetic` (SynthWorld). May import ``zsprob.errors``, ``zsprob.utils``,
``zsprob.methods`` and the root package only. Import the sub-module you need.
"""
