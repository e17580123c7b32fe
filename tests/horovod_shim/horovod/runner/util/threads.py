"""What Horovod's test/utils/common.py imports from horovod.runner (a helper its test_torch.py does not call)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):  # noqa: ANN001, ANN201 (Horovod's signature)
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
