"""The files ``megatok-export`` writes next to a byte model's weights so that transformers opens it with
``trust_remote_code=True`` and no megatok installed: ``configuration_megatok.py``, ``modeling_megatok.py``
(the byte U-net, its boundary rules and a generation cache) and ``tokenization_megatok.py`` (bytes, the
separator first). They import torch and transformers only (tests/hf/test_byte_model.py checks it).
docs/api.md, "The byte model in transformers"."""
