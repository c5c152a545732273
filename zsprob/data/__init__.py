"""zsprob.data: everything zsprob reads, real and embedded, and SynthWorld, the offline dataset.

Modules: ``webdataset`` (tar shards), ``coco`` / ``flickr`` (Karpathy splits), ``classification`` (ImageNet,
folders, SynthWorld's classify splits), ``masking`` / ``degrade`` / ``text_augment`` (copies of batches),
``transforms`` and ``synthetic``. May import ``zsprob.errors``, ``zsprob.utils``, ``zsprob.methods`` and the
root package only. Import the sub-module you need."""
