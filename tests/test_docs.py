"""The documentation site: it builds with warnings as errors, and a real headless Chromium shows a
rendered figure on every example page and every public name on the API page.

The build executes the notebooks at CI size (KERAS_BN_SMALL=1). Chromium and ChromeDriver are
Debian's (`chromium`, `chromium-driver`), which .ci/run installs; where they are missing the
browser test is skipped, except under KERAS_BN_REQUIRE_BROWSER=1 (set by .ci/run), where it fails.
"""

import html
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import keras
import pytest
from test_notebooks import BAD_OUTPUT, TENSORFLOW_LOG_LINE, kernel_environment

import keras_bn
import keras_bn.export
from helpers import docs_page

pytestmark = pytest.mark.backends("tensorflow")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module by `sphinx-build -W` (as `make docs` does)."""
    out = tmp_path_factory.mktemp("site")
    # Its own notebook cache and kernelspec, not build/docs: nothing is shared with a
    # `make docs` (or another build) running at the same time.
    env = {
        **kernel_environment(),  # the build `make docs` makes, outside pytest
        "KERAS_BN_SMALL": "1",
        "KERAS_BN_DOCS_BUILD": str(tmp_path_factory.mktemp("docs_build")),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            "html",
            "-q",
            str(ROOT / "docs"),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        message = "Debian's chromium and chromium-driver are not installed"
        if os.environ.get("KERAS_BN_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _rendered_images(driver, wait_s=10.0):
    """Images in the page's main content that the browser decoded (naturalWidth > 0), waiting
    up to `wait_s` for the first one (decoding can finish after the load event)."""
    deadline = time.monotonic() + wait_s
    while True:
        images = driver.execute_script(
            "return Array.from(document.querySelectorAll('main img, article img'))"
            ".filter(i => i.complete && i.naturalWidth > 0).map(i => i.src);"
        )
        if images or time.monotonic() > deadline:
            return images
        time.sleep(0.25)


# The site takes minutes to build: every test that uses it is in one xdist group, which
# `make test` (--dist loadgroup) runs on one worker, so it is built once.
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_each_example_page_shows_a_rendered_figure(site, browser, notebook):
    page = site / "examples" / f"{notebook.stem}.html"
    assert page.is_file(), f"no page for {notebook.name}"
    browser.get(page.as_uri())
    assert _rendered_images(browser), f"{page.name} shows no rendered figure"


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_performance_page_shows_the_ratio_plot(site, browser):
    browser.get((site / "guide" / "performance.html").as_uri())
    assert _rendered_images(browser), "the Performance page shows no rendered plot"
    text = browser.find_element("tag name", "main").text
    assert "keras_bn / Keras" in text and "Run: python benchmarks/bench_layer.py" in text


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_api_page_lists_every_public_name(site, browser):
    browser.get((site / "api.html").as_uri())
    anchors = set(
        browser.execute_script(
            "return Array.from(document.querySelectorAll('[id]')).map(e => e.id);"
        )
    )
    expected = {f"keras_bn.{name}" for name in keras_bn.__all__}
    expected |= {f"keras_bn.export.{name}" for name in keras_bn.export.__all__}
    missing = sorted(
        name for name in expected if name not in anchors and f"module-{name}" not in anchors
    )
    assert not missing, f"API page lacks {missing}"


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_tables_a_cell_displays_are_rendered(site):
    """The Performance page's tables come from its cells (display(Markdown(...))): they must be
    HTML tables, not lines of pipes."""
    page = (site / "guide" / "performance.html").read_text(encoding="utf-8")
    assert "| target | bound |" not in page and "|---|" not in page
    assert "Results at a glance" in page and page.count("<table") >= 10


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_no_page_shows_a_local_path_or_a_warning(site):
    """A page shows neither this machine's paths (the checkout, a virtualenv's site-packages)
    nor a Python warning a cell raised (whose first line names the file that raised it), nor
    TensorFlow's Python INFO lines (a conversion's "Assets written to: /tmp/..."), nor a
    traceback or a logging error (a log handler left on a closed stream). The
    site's kernels start plain, as a user's (examples/kernelspec.py): this is every cell's
    output, as a user's kernel shows it."""
    local = re.compile(
        re.escape(str(ROOT)) + r"|/site-packages/|\w+Warning: |" + BAD_OUTPUT.pattern
    )
    found = []
    for page in sorted(site.rglob("*.html")):
        text = html.unescape(re.sub(r"<[^>]*>", "", page.read_text(encoding="utf-8")))
        found += [f"{page.relative_to(site)}: {m.group(0)}" for m in local.finditer(text)]
    assert not found, found[:10]


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_api_page_shows_the_layers_real_signature(site):
    """Not Keras's `Layer.__new__(*args, **kwargs)`: the arguments of __init__."""
    text = html.unescape(re.sub(r"<[^>]*>", "", (site / "api.html").read_text(encoding="utf-8")))
    text = re.sub(r"\s+", " ", text)
    assert "keras_bn.BatchNormalization(axis=-1, momentum=0.99, epsilon=0.001" in text
    assert "(*args, **kwargs)" not in text


@pytest.mark.slow
@pytest.mark.xdist_group("docs_site")
def test_no_page_shows_tensorflow_log_lines(site):
    """TensorFlow's C++ logging (what it prints to the process's stderr as it loads and runs)
    stays out of the pages; Python warnings that a cell raises are still shown."""
    logged = []
    for page in sorted(site.rglob("*.html")):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            text = html.unescape(re.sub(r"<[^>]*>", "", line))
            if TENSORFLOW_LOG_LINE.search(text):
                logged.append(f"{page.relative_to(site)}:{number}: {text.strip()[:100]}")
    assert not logged, f"{len(logged)} TensorFlow log line(s):\n" + "\n".join(logged)


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, monkeypatch, capfd):
    """The README's tour trains, recalibrates, folds and writes two verified files, then
    trains a quantization-aware copy and writes its verified int8 file; it prints its one line,
    and what the converters and runtimes print goes into the reports' `log`, not stderr."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    keras.backend.clear_session()  # layer names count from scratch, as in a new process
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert [f.host for f in namespace["report"].folded] == ["conv2d"]
    assert namespace["report"].relative_error < 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.onnx",
        "model.tflite",
        "model_int8.tflite",
    ]
    qat_layers = [type(layer).__name__ for layer in namespace["qat"].layers]
    assert "QuantizedHostBatchNorm" in qat_layers, qat_layers
    out, err = capfd.readouterr()
    assert out.count("\n") == 1 and out.startswith("[FoldedBN("), out
    for raw in ("fully_quantize", "XNNPACK", "Interpreter is deprecated"):
        assert raw not in err, err[-2000:]
    assert not [line for line in err.splitlines() if TENSORFLOW_LOG_LINE.search(line)], err


def test_pages_name_the_backends_as_the_backends_page_does():
    """The landing page, the README, the install page and pyproject's description name the
    three backends docs/guide/backends.md gives a column, never TensorFlow alone, and none
    says PyTorch is not supported (yet)."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    texts = {
        "pyproject.toml": re.search(r'^description = "(.*)"$', pyproject, re.M).group(1),
        "README.md": (ROOT / "README.md").read_text(encoding="utf-8"),
        "docs/index.md": docs_page("index.md"),
        "docs/install.md": docs_page("install.md"),
    }
    for name, text in texts.items():
        assert "JAX" in text and "PyTorch" in text, name
        assert not re.search(r"\(TensorFlow( backend)?\)", text), name
        assert not re.search(r"PyTorch[^.]* (yet|not supported)\b|not yet on PyTorch", text), name
    assert "| PyTorch (the same) | NumPy, OpenVINO |" in docs_page("guide/backends.md")


def test_readme_fits_on_a_screen_and_links_only_to_files_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


# The tests that look for such citations (and so name them).
CITATION_CHECKERS = ("tests/test_docs.py", "tests/test_notebooks.py", "tests/test_docstrings.py")


def test_no_file_cites_documents_the_project_lacks():
    """Code, docs and notebooks cite papers and the project's own pages, never the design
    notes or seeds that lived outside the repository."""
    pattern = re.compile(r"shared/|design\.md|reference\.md|seeds/")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = [
        name
        for name in tracked
        if name not in CITATION_CHECKERS
        and (ROOT / name).is_file()
        and pattern.search((ROOT / name).read_text(encoding="utf-8", errors="ignore"))
    ]
    assert not offenders, offenders
