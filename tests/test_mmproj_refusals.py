"""An --mmproj the worker cannot run is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.integration.engine import REPO


def refusal(model: Path, mmproj: Path, tmp_path: Path) -> str:
    cmd = [sys.executable, "launcher.py", "--model", str(model), "--endpoint", f"ipc://{tmp_path}/c.sock",
           "--mmproj", str(mmproj)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.timeout(300)
def test_a_missing_file_a_non_gguf_and_another_projector(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert "no such file" in refusal(tiny_llama_dir, tmp_path / "none.gguf", tmp_path)
    (tmp_path / "text.gguf").write_text("not a gguf")
    assert "not a GGUF file" in refusal(tiny_llama_dir, tmp_path / "text.gguf", tmp_path)
    writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "clip")
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert "projector type 'qwen2vl_merger' is not supported" in refusal(
        tiny_llama_dir, tmp_path / "qwen.gguf", tmp_path
    )
