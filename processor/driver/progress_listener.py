"""A `StreamingQueryListener` that hears each progress report as Spark's own JSON.

PySpark's listener turns every report into Python objects before it calls
`onQueryProgress`, walking each of the report's Java maps (durations, event times, every
source's and the sink's metrics, observed metrics) over py4j: about 20 ms a map, most of it
the JVM searching every jar on its classpath for a class by name, and 100-126 ms a report
(`python -m bench.listener --json`). This listener asks the JVM for the report's JSON
instead: one call, about 1 ms, whatever the report holds.

It works through `StreamingQueryManager.addListener`, which registers `_jlistener`; where
PySpark registers the listener another way (Spark Connect), `onQueryProgress` receives
PySpark's event and reads the same JSON from it.
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql.streaming import StreamingQueryListener

_JAVA_LISTENER = "org.apache.spark.sql.streaming.PythonStreamingQueryListener"


class ProgressJsonListener(StreamingQueryListener):
    """Subclasses define `on_progress(progress)`: the report as Spark's JSON, parsed. It
    runs on Spark's listener thread; what it raises is logged by Spark and not re-raised."""

    def on_progress(self, progress: dict[str, Any]) -> None:
        raise NotImplementedError

    def onQueryStarted(self, event: Any) -> None:  # noqa: N802 - Spark's names
        pass

    def onQueryProgress(self, event: Any) -> None:  # noqa: N802
        self.on_progress(json.loads(event.progress.json))

    def onQueryIdle(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
        pass

    @property
    def _jlistener(self) -> Any:
        """The JVM side `addListener` and `removeListener` pass to Spark (one per listener)."""
        if not hasattr(self, "_jlistenerobj"):
            from pyspark import SparkContext

            jvm = SparkContext._jvm
            assert jvm is not None, "a listener needs a running SparkContext"
            wrapper = jvm.org.apache.spark.sql.streaming.PythonStreamingQueryListenerWrapper
            self._jlistenerobj = wrapper(self._callback())
        return self._jlistenerobj

    def _callback(self) -> _JsonCallback:
        """What the JVM calls with each event (`bench.listener` times its own)."""
        return _JsonCallback(self)


class _JsonCallback:
    """The py4j callback behind `ProgressJsonListener`: the JVM calls it with each event."""

    def __init__(self, listener: ProgressJsonListener) -> None:
        self.listener = listener

    def onQueryStarted(self, jevent: Any) -> None:  # noqa: N802
        pass

    def onQueryProgress(self, jevent: Any) -> None:  # noqa: N802
        self.listener.on_progress(json.loads(jevent.progress().json()))

    def onQueryIdle(self, jevent: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, jevent: Any) -> None:  # noqa: N802
        pass

    class Java:
        implements = [_JAVA_LISTENER]  # noqa: RUF012 - py4j reads this class attribute
