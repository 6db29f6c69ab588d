"""ops.gpu_train: a GPU training window prepared in advance (see ops/GPU_TRAINING.md).

Owns: packing what training needs into parts that fit the device machine's per-call transfer
limit (pack.py, CPU side), the parts format and its checks (parts.py, standard library only), the
pre-tokenised data file (tokens.py), and the training entry that runs on the device's own Python
(train_gpu.py). Must not touch: serving, the feature store, the registry's champion pointer.
"""
