"""The names of ``--quantization``'s choices, torch-free, for the settings records
(``config``): ``auto``, then one for each row of the table of quantizations
(``models.weights.quantizations.QUANTIZATIONS``, which checks that they agree when it is
imported), in its order. ``auto`` is no row: the engine resolves it to one at start
(``quantizations.resolve_quantization``)."""

QUANTIZATION_CHOICES = ("none", "int8", "int4", "w4a8", "w8a8", "gguf", "gguf-llama-cpp")
QUANTIZATION_OPTIONS = ("auto", *QUANTIZATION_CHOICES)
