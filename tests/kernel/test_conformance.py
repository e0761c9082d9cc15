"""jupyter_kernel_test (the community conformance suite) against the installed kernelspec, 1 and 4 ranks."""
from __future__ import annotations

import os
import shutil
import tempfile

import jupyter_kernel_test as jkt

from superkernel import install


class _SuperKernelConformance(jkt.KernelTests):
    __test__ = False
    ranks = 1
    kernel_name = ""
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "print?"
    code_generate_error = "raise Exception('boom')"
    code_execute_result = [{"code": "1+2+3", "mime": "text/plain"}, {"code": "[n*n for n in range(4)]"}]
    code_display_data = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))", "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))", "mime": "text/latex"},
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "range", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        cls._prefix = tempfile.mkdtemp(prefix="superkernel-jkt-")
        cls.kernel_name = f"superkernel-jkt-{cls.ranks}"
        install.install("torch", cls.kernel_name, cls.ranks, prefix=cls._prefix)
        cls._old_path = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.path.join(cls._prefix, "share", "jupyter")
        super().setUpClass()
        # wait until the pool is up, so no start-up progress lands in the tested cells
        cls.kc.execute_interactive("pass", timeout=180)

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        if cls._old_path is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = cls._old_path
        shutil.rmtree(cls._prefix, ignore_errors=True)


class TestOneRank(_SuperKernelConformance):
    __test__ = True
    ranks = 1
    code_execute_result = [{"code": "1+2+3", "result": "6"}, {"code": "[n*n for n in range(4)]", "result": "[0, 1, 4, 9]"}]


class TestFourRanks(_SuperKernelConformance):
    __test__ = True
    ranks = 4
    code_execute_result = [{"code": "1+2+3", "result": "[ranks 0-3] 6"},
                           {"code": "[n*n for n in range(4)]", "result": "[ranks 0-3] [0, 1, 4, 9]"}]


