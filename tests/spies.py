"""A stand-in for a jitted kernel that records its launches (grids, and arguments when it does not
forward them), so tests can check what a launcher asked for."""


class LaunchSpy:
    """``kernel[grid](*args, **kwargs)`` records ``grid`` in ``grids`` and either forwards the call to
    the real kernel or, with ``real=None``, records ``(args, kwargs)`` in ``calls`` and returns None."""

    def __init__(self, real=None):
        self.real, self.grids, self.calls = real, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        if self.real is not None:
            return self.real[grid]

        def record(*args, **kwargs):
            self.calls.append((args, kwargs))

        return record


def spy_launches(monkeypatch, module, name: str, forward: bool = True) -> LaunchSpy:
    """Replace ``module.name`` (a kernel) by a LaunchSpy for the test's duration."""
    spy = LaunchSpy(getattr(module, name) if forward else None)
    monkeypatch.setattr(module, name, spy)
    return spy


def record_launch_meta(monkeypatch, module, kernel) -> list:
    """Wrap ``module.launch`` (a launcher module's launch helper) so each launch of ``kernel`` appends
    its keyword arguments (constexprs, num_warps, ...) to the returned list, then runs for real."""
    metas = []
    real = module.launch

    def record(launched, grid, *args, **meta):
        if launched is kernel:
            metas.append(meta)
        return real(launched, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", record)
    return metas
