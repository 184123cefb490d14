"""The cpu runner made slower on purpose (20 ms per step): what a relative gate must catch."""
import time

from ffnq.backends.cpu import CpuRunner


class Slow(CpuRunner):
    def __call__(self, *args, **kwargs):
        time.sleep(0.02)
        return super().__call__(*args, **kwargs)
