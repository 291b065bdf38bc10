"""Images from stored bytes to model input, on the CPU or the worker's device, with reproducible augmentation.

``augment`` draws each image's augmentation record from (seed, epoch, step, slot), ``transforms``
decodes and applies it with Pillow in the loader processes. For device decoding, ``encoded`` is the loader
half (bytes and records handed over) and ``device`` the trainer half (nvJPEG decoding and the same records
applied with ``pixel_ops``, Pillow's arithmetic on tensors).
"""
