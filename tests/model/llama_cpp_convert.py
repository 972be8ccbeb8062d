"""Run llama.cpp's ``convert_hf_to_gguf.py`` (arguments as its own) without its vocabulary
step, which needs sentencepiece and a tokenizer it recognises; the tensors and the model's
hyper-parameters are written as the converter writes them.

    python llama_cpp_convert.py LLAMA_CPP_DIR MODEL_DIR --outfile OUT.gguf --outtype f32
"""

import sys

llama_cpp = sys.argv.pop(1)
sys.path[:0] = [llama_cpp, f"{llama_cpp}/gguf-py"]

import conversion.base as base  # noqa: E402
import conversion.phi as phi  # noqa: E402
import convert_hf_to_gguf  # noqa: E402


def no_vocab(self, *args, **kwargs) -> None:
    self.gguf_writer.add_tokenizer_model("none")


for name in list(vars(base.TextModel)):
    if name.startswith("_set_vocab_") or name == "set_vocab":
        setattr(base.TextModel, name, no_vocab)
phi.Phi3MiniModel.set_vocab = no_vocab  # its own, with sentencepiece inline

convert_hf_to_gguf.main()
