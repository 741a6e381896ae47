"""``python -m mmzoo.bench``: Hydra's command line over conf/bench.yaml (:func:`mmzoo.bench.main.run`)."""

from mmzoo.bench.main import main

if __name__ == "__main__":
    main()
