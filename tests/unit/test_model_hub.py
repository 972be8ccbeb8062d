"""Hub names and the GGUF file a name picks from a repository's files (no network)."""

from __future__ import annotations

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.model_hub import hub_name, local_model, pick_gguf

FILES = ["README.md", "m-Q4_K_M.gguf", "m-IQ4_K_M.gguf", "sub/m.q8_0.gguf", "mmproj-f16.gguf"]


@pytest.mark.parametrize(("name", "parsed"), [
    ("org/repo", ("org/repo", None)),
    ("Org-1/Repo.v2_x:Q4_K_M", ("Org-1/Repo.v2_x", "Q4_K_M")),
    ("org/repo:model-q8_0.gguf", ("org/repo", "model-q8_0.gguf")),
    ("./org/repo", None), ("/models/org/repo", None), ("org/repo/sub", None), ("repo", None),
    ("model.gguf", None), ("org/repo:", None),
])
def test_hub_names(name, parsed) -> None:
    assert hub_name(name) == parsed


def test_none_a_path_on_disk_and_a_non_hub_name_are_left_as_they_are(tmp_path) -> None:
    folder = tmp_path / "org" / "repo"
    folder.mkdir(parents=True)
    assert local_model(None) is None
    assert local_model(str(folder)) == str(folder)
    assert local_model(str(tmp_path / "missing.gguf")) == str(tmp_path / "missing.gguf")


@pytest.mark.parametrize(("pick", "chosen"), [
    (None, "m-Q4_K_M.gguf"), ("q4_k_m", "m-Q4_K_M.gguf"), ("IQ4_K_M", "m-IQ4_K_M.gguf"),
    ("Q8_0", "sub/m.q8_0.gguf"), ("m.q8_0.gguf", "sub/m.q8_0.gguf"),
    ("sub/m.q8_0.gguf", "sub/m.q8_0.gguf"),
])
def test_a_pick_names_one_gguf_file(pick, chosen) -> None:
    assert pick_gguf("org/repo", FILES, pick) == chosen


def test_one_gguf_file_needs_no_pick() -> None:
    assert pick_gguf("org/repo", ["a.json", "x-F16.gguf"], None) == "x-F16.gguf"


@pytest.mark.parametrize(("files", "pick", "message"), [
    (FILES, "Q5_K_M", "org/repo has no GGUF files ending in Q5_K_M; pick one as "
                      "org/repo:QUANT or org/repo:FILE from: m-IQ4_K_M.gguf, m-Q4_K_M.gguf, "
                      "m.q8_0.gguf"),
    (["a-Q8_0.gguf", "b-Q8_0.gguf"], None, "org/repo has several GGUF files; pick one"),
    (["a-Q8_0.gguf", "b-Q8_0.gguf"], "Q8_0", "several GGUF files ending in Q8_0; pick one"),
    (["config.json", "model.safetensors"], "Q8_0", "org/repo has no GGUF file to pick Q8_0"),
    (["README.md"], None, "org/repo holds neither a folder model"),
])
def test_a_pick_that_names_no_single_file_says_which_there_are(files, pick, message) -> None:
    with pytest.raises(ModelLoadError, match=message.replace(".", r"\.")):
        pick_gguf("org/repo", files, pick)
