"""Models named by their Hugging Face Hub repository, fetched into the Hub's cache.

    local_model("HuggingFaceTB/SmolLM2-135M-Instruct")          # an HF folder repository
    local_model("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")  # one GGUF file of a repository
    local_model("bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q8_0.gguf")

A name is ``org/repo``, optionally followed by ``:PICK``, where ``PICK`` is a quantization
tag that ends one GGUF file's name (``Q4_K_M``, any case), or a whole ``.gguf`` file name.
Downloads go through ``huggingface_hub``: its cache (``HF_HOME``, ``HF_HUB_CACHE``), its
resumption of a broken download, its progress bars, ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE``.

Invariants:

- Nothing is downloaded for ``None`` (the embedded model) or for a name that exists on
  disk: a local path always wins over a repository of the same name.
- A repository without ``:PICK`` is a folder model when it holds ``config.json`` and
  ``*.safetensors`` (only the files a folder model needs are fetched); otherwise it must
  hold one GGUF file, or one whose name ends in ``Q4_K_M`` (llama.cpp's default pick).
- With ``HF_HUB_OFFLINE`` set the network is never used: the cache has the model or the
  error says it does not.
- Every failure is a ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import logging
import os
import re

from tokenmill.errors import ModelLoadError

logger = logging.getLogger("tokenmill")

HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<pick>[\w.-]+))?")
# What a folder model reads: config, weights, tokenizer, chat template.
FOLDER_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")
DEFAULT_GGUF_PICK = "Q4_K_M"


def hub_name(model: str) -> tuple[str, str | None] | None:
    """``(repo, pick)`` when ``model`` is spelled as a Hub name, else None."""
    match = HUB_NAME.fullmatch(model)
    return (match["repo"], match["pick"]) if match else None


def local_model(model: str | None) -> str | None:
    """Where ``model`` is on disk: itself when it is None, on disk, or not a Hub name (the
    loader reports a missing path), else the file or folder fetched from the Hub."""
    if model is None or os.path.exists(model):
        return model
    name = hub_name(model)
    return model if name is None else fetch(*name)


def fetch(repo: str, pick: str | None) -> str:
    """The local path of ``repo``'s model (see the module's invariants)."""
    import huggingface_hub as hub
    from huggingface_hub import errors

    where = "the Hugging Face cache" if hub.is_offline_mode() else hub.constants.ENDPOINT
    try:
        files = _repo_files(repo)
        if pick is None and "config.json" in files and any(
                f.endswith(".safetensors") for f in files):
            logger.info("model %s: fetching a folder model from %s", repo, where)
            return hub.snapshot_download(repo, allow_patterns=list(FOLDER_FILES))
        filename = pick_gguf(repo, files, pick)
        logger.info("model %s: fetching %s from %s", repo, filename, where)
        return hub.hf_hub_download(repo, filename)
    except errors.GatedRepoError:
        raise ModelLoadError(f"{repo} is gated: accept its terms on the Hub and log in "
                             f"(hf auth login, or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(f"no model repository {repo} on {where} (nor a file or folder "
                             f"of that name); a private one needs a login (hf auth login, "
                             f"or HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError:
        raise ModelLoadError(f"{repo} is not in the Hugging Face cache, and "
                             + ("HF_HUB_OFFLINE is set" if hub.is_offline_mode()
                                else f"{where} cannot be reached")) from None
    except errors.EntryNotFoundError:
        raise ModelLoadError(f"{repo} on {where} has no file {pick}") from None
    except (errors.HfHubHTTPError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"fetching {repo} from {where} failed: {reason}") from None


def _repo_files(repo: str) -> list[str]:
    """The repository's file names: from the Hub, or offline from its cached snapshot."""
    import huggingface_hub as hub

    if not hub.is_offline_mode():
        return hub.list_repo_files(repo)
    snapshot = hub.snapshot_download(repo, local_files_only=True)
    return [os.path.relpath(os.path.join(folder, name), snapshot)
            for folder, _, names in os.walk(snapshot) for name in names]


def pick_gguf(repo: str, files: list[str], pick: str | None) -> str:
    """The one GGUF file of ``files`` that ``pick`` names (see the module's docstring)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and "mmproj" not in os.path.basename(f).lower())
    if not ggufs:
        raise ModelLoadError(f"{repo} holds neither a folder model (config.json and "
                             f"*.safetensors) nor a GGUF file" if pick is None else
                             f"{repo} has no GGUF file to pick {pick} from")
    if pick is None:
        chosen = ggufs if len(ggufs) == 1 else _ending_in(ggufs, DEFAULT_GGUF_PICK)
        problem = "several GGUF files"
    elif pick.lower().endswith(".gguf"):
        chosen = [f for f in ggufs if pick in (f, os.path.basename(f))]
        problem = f"no GGUF file {pick}"
    else:
        chosen = _ending_in(ggufs, pick)
        problem = f"{'several' if chosen else 'no'} GGUF files ending in {pick}"
    if len(chosen) == 1:
        return chosen[0]
    raise ModelLoadError(f"{repo} has {problem}; pick one as {repo}:QUANT or {repo}:FILE "
                         f"from: {', '.join(os.path.basename(f) for f in chosen or ggufs)}")


def _ending_in(files: list[str], tag: str) -> list[str]:
    """The GGUF files whose name ends in ``tag`` (any case) after a separator:
    ``x-Q4_K_M.gguf`` and ``x.q4_k_m.gguf`` end in ``Q4_K_M``, ``x-IQ4_K_M.gguf`` does not."""
    ending = re.compile(rf"(?:^|[-._]){re.escape(tag)}\.gguf$", re.IGNORECASE)
    return [f for f in files if ending.search(os.path.basename(f))]
