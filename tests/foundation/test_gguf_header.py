"""The fast metadata reader returns exactly what the gguf package reads, for every key of the real model."""

import gguf
import pytest

from chatmesh.gguf_header import read_gguf_header, read_gguf_metadata
from chatmesh.model_files import bundled_model_path


def test_every_key_matches_the_gguf_package():
    path = bundled_model_path()
    ours = read_gguf_metadata(path)
    theirs = {key: field.contents() for key, field in gguf.GGUFReader(str(path)).fields.items()}
    # The reference also exposes the header (GGUF.version, tensor and kv counts) as pseudo-fields.
    theirs = {key: value for key, value in theirs.items() if not key.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(path)


def test_tensor_directory_matches_the_gguf_package():
    path = bundled_model_path()
    ours = read_gguf_header(path).tensors
    theirs = gguf.GGUFReader(str(path)).tensors
    assert len(ours) == len(theirs) == 272
    for tensor in theirs:
        info = ours[tensor.name]
        assert info.dims == tuple(int(d) for d in tensor.shape)
        assert info.ggml_type == tensor.tensor_type
        assert info.offset == tensor.data_offset
