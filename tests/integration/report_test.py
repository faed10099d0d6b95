#!/usr/bin/env python3
"""`fp8rt report` end to end (issue 20 point 4), as a user runs it.

1. A real run: `fp8rt launch tests/data/tiny-plain.yaml --np 2` under the controller the launcher
   starts, 24 steps, checkpoints every 8, per-rank FP8 statistics every step, validation every 8.
   A live per-layer recipe (`fp8rt recipe set --override`) while it trains gives the timeline a
   second recipe version and a recipe_applied event.
2. `fp8rt report RUN_DIR --out FILE`: exit 0, the path printed, one file that names no network
   resource (no script, no link, no src, no url() but in-page references).
3. Debian's Chromium, headless, loads the file: its DOM (--dump-dom, after the browser parsed
   it) holds the plots with the expected element counts (a line per series, a heatmap cell per
   site and step, an event mark per recorded event, a checkpoint mark per checkpoint), and a
   screenshot is not blank (many colours, a good share of non-white pixels; decoded here with
   zlib, no imaging library).
4. Bad input: a folder without metrics.jsonl and a corrupt metrics line are refused with exit 2,
   naming the file (and the line), quoting a bounded prefix.

Usage: report_test.py BIN_DIR SOURCE_DIR. Exit 77 (ctest: skipped) naming the reason when
Chromium is not installed (scripts/bootstrap installs it).
"""

import html.parser
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

SKIP = 77


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print("ok: " + msg)


class Dom(html.parser.HTMLParser):
    """Elements by tag with their attributes, and which <svg id=...> each lies in."""

    def __init__(self):
        super().__init__()
        self.elements = []  # (tag, attrs, enclosing svg id)
        self.svg = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svg.append(a.get("id", ""))
        self.elements.append((tag, a, self.svg[-1] if self.svg else None))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "svg":
            self.svg.pop()

    def handle_endtag(self, tag):
        if tag == "svg" and self.svg:
            self.svg.pop()

    def count(self, tag, svg=None, cls=None):
        n = 0
        for t, a, s in self.elements:
            if t != tag or (svg is not None and s != svg):
                continue
            if cls is not None and cls not in a.get("class", "").split():
                continue
            n += 1
        return n


def png_pixels(path):
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(path + " is not a PNG")
    at, idat, width = 8, b"", 0
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            if depth != 8 or colour not in (2, 6):
                fail("unexpected PNG format: depth %d colour type %d" % (depth, colour))
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def run(argv, **kw):
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def main():
    bin_dir, source = sys.argv[1], sys.argv[2]
    chromium = shutil.which("chromium")
    if chromium is None:
        print("SKIP: Debian's chromium is not installed (scripts/bootstrap installs it)")
        return SKIP
    fp8rt = os.path.join(bin_dir, "fp8rt")
    tmp = tempfile.mkdtemp(prefix="fp8rt-report-")
    try:
        spec = open(os.path.join(source, "tests/data/tiny-plain.yaml")).read()
        spec = spec.replace("path: examples/data/kjv.txt",
                            "path: " + os.path.join(source, "examples/data/kjv.txt"))
        spec_path = os.path.join(tmp, "tiny.yaml")
        open(spec_path, "w").write(spec)
        run_dir = os.path.join(tmp, "run")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        launch = subprocess.Popen(
            [fp8rt, "launch", spec_path, "--np", "2", "--run-dir", run_dir, "--run-id", "report",
             "--set", "train.steps=24", "--set", "train.warmup=4", "--set", "checkpoint.every=8",
             "--set", "metrics.every=1", "--set", "eval.every=8", "--set", "eval.batches=2",
             "--set", "data.val_fraction=0.01"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        # A live per-layer recipe once the run reports steps, through the launcher's controller.
        metrics = os.path.join(run_dir, "metrics.jsonl")
        address_file = os.path.join(run_dir, "controller", "ready.json")
        deadline = time.time() + 120
        updated = False
        while time.time() < deadline and launch.poll() is None and not updated:
            time.sleep(0.2)
            try:
                steps = sum(1 for _ in open(metrics))
                ready = json.load(open(address_file))
            except (OSError, ValueError):
                continue
            if steps < 3:
                continue
            r = run([fp8rt, "recipe", "set", "report", "--override", "blocks.1.mlp.*:mode=bf16",
                     "--reason", "report test"],
                    env=dict(env, FP8RT_CONTROLLER=ready["grpc"],
                             FP8RT_TOKEN_FILE=os.path.join(run_dir, "controller", "token")))
            check(r.returncode == 0, "fp8rt recipe set during the run: " + r.stdout + r.stderr)
            updated = True
        out, _ = launch.communicate(timeout=300)
        check(launch.returncode == 0, "the run finished: " + out[-3000:])
        check(updated, "a recipe was set while the run trained")
        check(os.path.exists(os.path.join(run_dir, "events.jsonl")),
              "fp8rt launch recorded the controller's events in events.jsonl")
        events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
        kinds = [e["kind"] for e in events]
        print("events:", kinds)
        check("recipe_applied" in kinds and "checkpoint_committed" in kinds
              and "run_finished" in kinds, "events recorded: recipe applied, checkpoints, finish")
        steps = [json.loads(l) for l in open(metrics)]
        versions = sorted({s["recipe_version"] for s in steps})
        check(versions == [1, 2], "two recipe versions trained: %s" % versions)

        report = os.path.join(tmp, "out", "r.html")
        os.makedirs(os.path.dirname(report))
        r = run([fp8rt, "report", run_dir, "--out", report])
        check(r.returncode == 0, "fp8rt report exits 0: " + r.stderr)
        check(report in r.stdout, "the path is printed: " + r.stdout.strip())
        page = open(report).read()
        lower = page.lower()
        check("<script" not in lower and "<link" not in lower and " src=" not in lower,
              "no script, link or src")
        check(all(u.startswith("url(#") for u in
                  [page[i:i + 5] for i in range(len(page)) if page.startswith("url(", i)]),
              "url() only for in-page references")
        for scheme in ("https://", "http://"):
            for i in range(len(page)):
                if page.startswith(scheme, i):
                    check(page.startswith("http://www.w3.org/2000/svg", i),
                          "the only address is the SVG namespace")

        # The browser's DOM.
        profile = os.path.join(tmp, "chrome-profile")
        base = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--user-data-dir=" + profile, "--no-first-run",
                "--hide-scrollbars"]
        r = run(base + ["--dump-dom", "file://" + report], timeout=120)
        check(r.returncode == 0 and "</html>" in r.stdout,
              "chromium loaded the report (--dump-dom): " + r.stderr[-500:])
        dom = Dom()
        dom.feed(r.stdout)
        plots = dom.count("svg", cls="plot")
        check(plots == 8, "8 plots (loss, grad norm, tokens/s, timeline, 4 heatmaps): %d" % plots)
        check(dom.count("polyline", svg="loss", cls="series") >= 2,
              "loss and validation loss drawn")
        check(dom.count("polyline", svg="grad-norm", cls="series") >= 1, "gradient norm drawn")
        check(dom.count("polyline", svg="tokens-per-s", cls="series") >= 1, "tokens/s drawn")
        sites = set()
        site_steps = set()
        for name in os.listdir(os.path.join(run_dir, "fp8_stats")):
            for line in open(os.path.join(run_dir, "fp8_stats", name)):
                j = json.loads(line)
                if "site" in j:
                    sites.add(j["site"])
                    site_steps.add(j["step"])
        cells = len(sites) * len(site_steps)
        for heat in ("heat-scale", "heat-amax", "heat-underflow", "heat-saturation"):
            n = dom.count("rect", svg=heat, cls="cell")
            check(n == cells, "%s: a cell per site and step (%d sites x %d steps = %d): %d" %
                  (heat, len(sites), len(site_steps), cells, n))
        check(dom.count("circle", svg="timeline", cls="event") == len(events),
              "an event mark per recorded event (%d)" % len(events))
        checkpoints = [d for d in os.listdir(os.path.join(run_dir, "checkpoints"))
                       if d.startswith("step-")]
        check(dom.count("path", svg="timeline", cls="checkpoint") == len(checkpoints),
              "a checkpoint mark per checkpoint (%d)" % len(checkpoints))
        check(dom.count("rect", svg="timeline", cls="recipe-band") == 2,
              "two recipe-version bands")

        # A screenshot that is not blank.
        shot = os.path.join(tmp, "shot.png")
        r = run(base + ["--screenshot=" + shot, "--window-size=1000,2600", "file://" + report],
                timeout=120)
        check(r.returncode == 0 and os.path.exists(shot), "screenshot taken: " + r.stderr[-500:])
        width, height, bpp, rows = png_pixels(shot)
        colours, non_white = set(), 0
        for y in range(0, height, 2):
            row = rows[y]
            for x in range(0, width, 2):
                px = row[x * bpp:x * bpp + 3]
                colours.add(px)
                if px != b"\xff\xff\xff":
                    non_white += 1
        share = non_white / ((height // 2) * (width // 2))
        print("screenshot %dx%d: %d colours, %.1f%% non-white" %
              (width, height, len(colours), 100 * share))
        check(len(colours) > 50, "the screenshot has many colours (plots drawn)")
        check(share > 0.05, "the screenshot is not blank")

        # Bad input.
        empty = os.path.join(tmp, "empty")
        os.makedirs(empty)
        r = run([fp8rt, "report", empty])
        check(r.returncode == 2 and "metrics.jsonl" in r.stderr,
              "a folder without metrics.jsonl: exit 2 naming it: " + r.stderr.strip())
        bad = os.path.join(tmp, "bad")
        os.makedirs(bad)
        with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
            f.write('{"step": 1, "loss": 5}\n' + "x" * 10000 + "\n")
        r = run([fp8rt, "report", bad])
        check(r.returncode == 2 and "metrics.jsonl:2: not a JSON object" in r.stderr
              and len(r.stderr) < 400,
              "a corrupt line: exit 2 naming file and line, bounded: " + r.stderr[:200])
        check(not os.path.exists(os.path.join(bad, "report.html")), "nothing written")
        r = run([fp8rt, "report"])
        check(r.returncode == 2 and "RUN_DIR is required" in r.stderr, "RUN_DIR required")
    finally:
        if os.environ.get("FP8RT_KEEP_TEST_DIRS"):
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
