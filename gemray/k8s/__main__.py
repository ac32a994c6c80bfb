"""``python -m gemray.k8s render | validate | regenerate ...`` (the command deploy/README.md gives for
re-rendering deploy/*.yaml): see :func:`gemray.k8s.cli.main`."""

from gemray.k8s.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
