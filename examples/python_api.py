"""quantkit from Python: RTN and GPTQ on the built-in model, evaluated and compared.

    .venv/bin/python examples/python_api.py
"""

from __future__ import annotations

from pathlib import Path

from quantkit.eval.logits import PPLConvention
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.report import collect, write_report
from quantkit.types import QuantScheme

OUT = Path("out/examples/api")
scheme = QuantScheme(bits=4, group_size=64, symmetric=True)
for method in ("rtn", "gptq"):
    quantize(QuantizeRequest(model="smollm2-135m", method=method, scheme=scheme,
                             out=OUT / method, calib_samples=32, force=True))
# one pass of the base model over the held-out text, shared by both artifacts
summary = collect([str(OUT / "rtn"), str(OUT / "gptq")], "smollm2-135m",
                  conv=PPLConvention(ctx=512, max_windows=8), title="RTN vs GPTQ (API example)")
paths = write_report(summary, OUT / "report.html")
for row in summary["rows"]:
    kld, top1 = row.get("kld") or {}, row.get("top1") or {}
    print(f"{row['label']:28s} PPL {row['ppl']['value']:.3f}  KLD {kld.get('mean', float('nan')):.4f}"
          f"  top-1 {100 * top1.get('value', float('nan')):.1f} %")
print("report:", paths["html"])
