"""The names of ``--quantization``'s choices, torch-free, for the settings records
(``config``): one for each row of the table of quantizations
(``models.weights.quantizations.QUANTIZATIONS``, which checks that they agree when it is
imported), in its order."""

QUANTIZATION_CHOICES = ("none", "int8", "int4", "w4a8", "w8a8", "gguf", "gguf-llama-cpp")
