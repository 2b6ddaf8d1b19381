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


def patch_routes(monkeypatch, **changes):
    """Every decode call's route as ``select_route`` picks it, with ``changes`` applied (``dataclasses.replace``:
    e.g. ``stages=3``, ``pages_per_tile=0``), for the test's duration; returns the list of routes taken."""
    import dataclasses

    from flashtile.backends.triton import decode

    taken = []
    real = decode.select_route

    def select(*args, **kwargs):
        route = dataclasses.replace(real(*args, **kwargs), **changes)
        taken.append(route)
        return route

    monkeypatch.setattr(decode, "select_route", select)
    return taken


def force_rows(monkeypatch, heads: int, **changes):
    """Every decode call on the whole-row kernel with ``heads`` kv heads a program (the route's knobs for that
    count, then ``changes``); returns the list of routes taken."""
    import dataclasses

    from flashtile.backends.triton import decode
    from flashtile.backends.triton.decode import route as R

    taken = []

    def select(shape, dtype, paged, page_size, props, **settings):
        route = dataclasses.replace(R._rows_route(shape, dtype, paged, heads, props, settings.get("pdl")), **changes)
        taken.append(route)
        return route

    monkeypatch.setattr(decode, "select_route", select)
    return taken


def record_kernels(monkeypatch) -> list:
    """Every decode call's route kernel ("split", "rows", "gluon") and knobs, recorded; the routes are not
    changed."""
    return patch_routes(monkeypatch)


def force_gluon(monkeypatch, splits: int):
    """Every decode call on the Gluon warps-along-keys kernel split ``splits`` ways (the route's other knobs for
    that count); returns the list of routes taken."""
    from flashtile.backends.triton import decode
    from flashtile.backends.triton.decode import route as R

    taken = []

    def select(shape, dtype, paged, page_size, props, **settings):
        route = R._gluon_route(shape, dtype, splits, props, settings.get("pdl"))
        taken.append(route)
        return route

    monkeypatch.setattr(decode, "select_route", select)
    return taken
