"""PySpark's worker daemon, started with PySpark's installed package on the path instead of
Spark's zip of it (`shardless.processor.runtime.installed_pyspark`): every Python worker Spark
forks from it imports compiled modules. Spark runs it as `python -m` this module, with the
worker module as its argument, as it would run `pyspark.daemon`."""

if __name__ == "__main__":
    from shardless.processor.runtime.installed_pyspark import prefer_installed

    prefer_installed()
    from pyspark import daemon

    daemon.manager()
