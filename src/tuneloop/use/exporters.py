"""`tuneloop export --format NAME`: one record per export format, which the command and its help read.

A format is its writer (a package of its own, like gguf/) and one `EXPORTERS.add` here: the command-line choices of
`--format` and `--quant`, their help, the output file's suffix, and what is printed after the export all come from
the record, so commands.py knows no format. Light at import (`tuneloop --help` reads it): each writer is imported
when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from tuneloop.registry import Registry
from tuneloop.use.gguf.quantize import QUANTIZATIONS


@dataclass(frozen=True)
class Exporter:
    summary: str  # what it writes, for the command's help
    suffix: str  # the output file's (".gguf"): the default name's, and what --output must end in
    readers: str  # the programs that look for that suffix, for the error that refuses another
    quantizations: Registry  # what --quant may name
    default_quant: str
    default_quant_note: str  # why it is the default, for --quant's help
    quant_note: str  # what no --quant changes
    # (folder, output, quant, *, overwrite, trust_remote_code, base_quantization, say) -> the export's result
    write: Callable
    hints: Callable[[object], Iterable[str]]  # (the export's result) -> the lines printed after it: how to run it
    # (a --quant it does not write, output_for(quant) -> the file an export at that --quant writes) -> the message
    # that says how to get that file some other way, or None
    elsewhere: Callable[[str, Callable[[str], Path]], str | None] = lambda name, output_for: None

    def quant_help(self) -> str:
        others = [name for name in self.quantizations.names() if name != self.default_quant]
        return f"{self.default_quant} (the default: {self.default_quant_note}), {', '.join(others)}; {self.quant_note}"


def _write_gguf(folder, output: Path, quant: str, **options):
    from tuneloop.use.gguf.write import export_gguf

    return export_gguf(folder, output, quant, **options)


def _gguf_elsewhere(name: str, output_for) -> str | None:
    from tuneloop.use.gguf.quantize import elsewhere

    return elsewhere(name, output_for)


def _gguf_hints(done) -> list[str]:
    return [f"exported {done.gguf} ({done.bytes / 1e6:.1f} MB) and {done.modelfile}; run it with:",
            f"  llama-cli -m {done.gguf} -cnv        # llama.cpp",
            f"  cd {done.gguf.parent} && ollama create NAME -f {done.modelfile.name} && ollama run NAME"]


EXPORTERS: Registry[Exporter] = Registry("export format", "--format")
EXPORTERS.add("gguf", Exporter(
    summary="one GGUF file for llama.cpp / Ollama, with an Ollama Modelfile beside it", suffix=".gguf",
    readers="llama.cpp and Ollama", quantizations=QUANTIZATIONS, default_quant="q8_0",
    default_quant_note="close to f16, half its size", quant_note="norms and biases stay f32",
    write=_write_gguf, hints=_gguf_hints, elsewhere=_gguf_elsewhere))

