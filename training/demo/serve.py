"""The serving part of ``make demo`` (steps.py ``serve``): the demo's export, served.

The demo's training export and tiny components -> the serving export -> CPU graphs
(``torch.jit.trace``) -> a model directory in model.tar.gz's layout -> a serving bench JSON and
a report with its "Serving" section -> the local server on a free loopback port -> one image
fetched through ``POST /invocations`` and saved. Everything runs on this CPU with the tiny model:
the figures show the path, not an accelerator.
"""

from __future__ import annotations

import datetime
import http.client
import json
import shutil
from pathlib import Path

from training.errors import UserError


def serve_demo(out: Path, *, transformer: Path, models: Path, prompt: str, steps: int = 4) -> dict[str, Path]:
    from training.model.tiny import TINY_RESOLUTION
    from training.report.cli import main as report_main
    from training.serve.bench import run_bench
    from training.serve.compile import compile_export
    from training.serve.export import build_serving_export
    from training.serve.server import running
    from training.serve.spec import Limits, Size

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    model = out / "model"
    size = Size(TINY_RESOLUTION, TINY_RESOLUTION)
    export = build_serving_export(transformer=transformer, vae=models / "vae", out=model / "export", sizes=(size,),
                                  dtype="fp32", limits=Limits(max_steps=20, default_steps=steps))
    compile_export(export, model / "compiled", target="cpu", log=lambda line: print(f"    {line}", flush=True))
    result = run_bench(model, steps=steps, requests=3, warmup=1, instance_type="local",
                       notes="make demo: tiny model on this CPU, not an accelerator")
    bench = out / "serve-bench-local.json"
    bench.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    prices = out / "prices-demo.yaml"
    today = datetime.date.today().isoformat()
    prices.write_text(f'# Demo only: an illustrative round number for this CPU ("local"), not a price.\n'
                      f'as_of: "{today}"\ncurrency: USD\nregion: local\nprices:\n  local:\n    usd_per_hour: 1.0\n'
                      f'    source: "illustrative round number for a local CPU (make demo)"\n'
                      f'    checked: "{today}"\n    verified: false\n')
    report_main(["--project", "--out", str(out / "report"), "--prices", str(prices), "--serving", str(bench)])
    image = out / "served.png"
    with running(model, port=0) as server:  # port 0: a free loopback port
        server.wait_ready(300)
        host, port = server.httpd.server_address[:2]
        conn = http.client.HTTPConnection(host, port, timeout=300)
        conn.request("POST", "/invocations", body=json.dumps({"prompt": prompt, "steps": steps, "seed": 0}),
                     headers={"Content-Type": "application/json", "Accept": "image/png"})
        response = conn.getresponse()
        body = response.read()
        conn.close()
        if response.status != 200:
            raise UserError(f"demo serve: /invocations answered {response.status}: {body.decode(errors='replace')}")
    image.write_bytes(body)
    return {"serving export": model / "export", "compiled graphs (cpu) + manifest": model / "compiled",
            "serving bench (CPU figures)": bench, "serving report (Serving section)": out / "report" / "report.md",
            "served image (via POST /invocations)": image}
