"""One module per model family: its ``FAMILY`` record (``family.ModelFamily``) and the
``MODEL`` class that runs it, over the shared layers (``layers/``) and attention backends
(``attention/``). A family that is Llama's graph with a few differences names
``llama.LlamaForCausalLM``; one with another graph (Gemma 3) defines its own. Adding a
family is one module here and one line of ``registry.FAMILIES``."""
