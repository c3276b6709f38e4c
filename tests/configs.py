"""Configs for the config tests: one good, and the bad ones, each with the error that names it.

Each bad case is (name, the config's text, what the error must say)."""

from __future__ import annotations

GOOD = """
default_runtime = "llamacpp"

[proxy]
port = 8000
model = "smollm2"

[runtimes.llamacpp]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/models/m.gguf"

[runtimes.vllm]
engine = "vllm"
model = "/models/hf"
"""

# Two runtimes that take turns on one card, each with a name (and so a port) of its own
TWO_NAMES = GOOD.replace(
    'model = "/models/hf"', 'model = "/models/hf"\nserved_model_name = "big"\nport = 8002'
)

# (name, config text, text the error must contain: the dotted key and what is wrong)
BAD = [
    (
        "vllm shutdown timeout in args",
        GOOD.replace(
            'model = "/models/hf"', 'model = "/models/hf"\nargs = ["--shutdown-timeout=5"]'
        ),
        "runtimes.vllm.args: sets --shutdown-timeout, which the appliance sets itself",
    ),
    (
        "negative drain",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\ndrain_s = -1'),
        "proxy.drain_s: -1.0 must not be negative",
    ),
    ("toml syntax", "default_runtime = ", "not valid TOML"),
    (
        "an API the door does not open",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\napis = ["chat", "embeddings"]'),
        "runtimes.vllm.apis[0]: 'chat' is not an API the door opens",
    ),
    (
        "no API at all",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\napis = []'),
        "runtimes.vllm.apis: must name at least one API",
    ),
    (
        "an API named twice",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\napis = ["rerank", "rerank"]'),
        "runtimes.vllm.apis[1]: 'rerank' is named twice",
    ),
    ("unknown top key", GOOD + "\nmodel_dir = '/x'\n", "model_dir: unknown key"),
    (
        "typo in runtime key",
        GOOD.replace('model = "/models/hf"', 'modle = "/models/hf"'),
        "runtimes.vllm.modle: unknown key",
    ),
    ("missing model", GOOD.replace('model = "/models/hf"', ""), "runtimes.vllm.model: missing"),
    (
        "port not a number",
        GOOD.replace("port = 8000", 'port = "8000"'),
        "proxy.port: must be an integer, not a string",
    ),
    (
        "port out of range",
        GOOD.replace("port = 8000", "port = 70000"),
        "proxy.port: 70000 is not a TCP port",
    ),
    (
        "same port twice",
        GOOD + "\n[backend]\nport = 8000\n",
        "backend.port: 8000 is also proxy.port",
    ),
    (
        "bad engine",
        GOOD.replace('engine = "vllm"', 'engine = "tgi"'),
        "runtimes.vllm.engine: 'tgi' is not one of",
    ),
    (
        "bad launcher",
        GOOD.replace('engine = "vllm"', 'engine = "vllm"\nlauncher = "lxc"'),
        "runtimes.vllm.launcher: 'lxc' is not one of",
    ),
    (
        "docker without image",
        GOOD.replace('engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"'),
        "runtimes.vllm.image: missing",
    ),
    (
        "default not configured",
        GOOD.replace('default_runtime = "llamacpp"', 'default_runtime = "tgi"'),
        "default_runtime: 'tgi' is not a configured runtime",
    ),
    ("no runtimes", "[proxy]\nport = 8000\n", "runtimes: no runtime is configured"),
    (
        "bad runtime name",
        GOOD.replace("[runtimes.vllm]", "[runtimes.VLLM_big]"),
        "runtimes.VLLM_big: a runtime name",
    ),
    (
        "args set the port",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nargs = ["--port", "9"]'),
        "runtimes.vllm.args: sets --port",
    ),
    (
        "env not a string",
        GOOD + "\n[runtimes.vllm.env]\nVLLM_CPU_KVCACHE_SPACE = 1\n",
        "runtimes.vllm.env.VLLM_CPU_KVCACHE_SPACE: must be a string",
    ),
    (
        "negative timeout",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nstart_timeout_s = -5'),
        "runtimes.vllm.start_timeout_s: -5.0 must be at least 1",
    ),
    (
        "mmproj on vllm",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nmmproj = "/m.gguf"'),
        "runtimes.vllm.mmproj: only the llamacpp engine",
    ),
    (
        "args not a list",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nargs = "--enforce-eager"'),
        "runtimes.vllm.args: must be a list of strings",
    ),
    (
        "proxy not a table",
        GOOD.replace('[proxy]\nport = 8000\nmodel = "smollm2"', "proxy = 8000"),
        "proxy: must be a table",
    ),
    (
        "bad model name",
        GOOD.replace('model = "smollm2"', 'model = "small model"'),
        "proxy.model: 'small model'",
    ),
    (
        "bad gpu device",
        GOOD + '\n[gpu]\ndevice = "card0"\n',
        "gpu.device: 'card0' is neither 'auto'",
    ),
    (
        "relative b70ctl",
        'b70ctl = "bin/b70ctl"\n' + GOOD,
        "b70ctl: 'bin/b70ctl' must be an absolute path",
    ),
    (
        "command on docker",
        GOOD.replace(
            'engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"\nimage = "x"\ncommand = ["/x"]'
        ),
        "runtimes.vllm.command: container launchers",
    ),
    (
        "on demand with one served name",
        GOOD + "\n[switching]\non_demand = true\n",
        "switching.on_demand: every runtime serves 'smollm2' on port 8001",
    ),
    (
        "on demand that would time out before a request's turn",
        TWO_NAMES + "\n[switching]\non_demand = true\nmax_wait_s = 300\n",
        "switching.max_wait_s: 300 s is not below proxy.hold_s (300 s)",
    ),
    (
        "on demand with a batch below none",
        TWO_NAMES + "\n[switching]\non_demand = true\nbatch = -1\n",
        "switching.batch: -1",
    ),
    (
        "an order of switching that is not one",
        TWO_NAMES + '\n[switching]\non_demand = true\norder = "lifo"\n',
        "switching.order: 'lifo' is not an order",
    ),
    (
        "first come, first served against another order",
        TWO_NAMES + '\n[switching]\non_demand = true\norder = "collated"\nfcfs = true\n',
        "switching.fcfs: says first come, first served where order is 'collated'",
    ),
    (
        "an order without switching on demand",
        TWO_NAMES + '\n[switching]\norder = "collated"\n',
        "switching.order: is the order of switching on demand",
    ),
    ("a typo in switching", TWO_NAMES + "\n[switching]\non_demnd = true\n", "switching.on_demnd"),
]

# Values that would reach further than they should: into another line of a unit file, another
# listener's port, another unit's name, or a flag of the runtime.
REACH = [
    (
        "newline in an arg",
        GOOD.replace(
            'model = "/models/hf"',
            'model = "/models/hf"\nargs = ["--x", "a\\nExecStartPre=/bin/sh -c id"]',
        ),
        "runtimes.vllm.args[1]: holds the control character '\\n' at position 1",
    ),
    (
        "NUL in an arg",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nargs = ["a\\u0000b"]'),
        "runtimes.vllm.args[0]: holds the control character '\\x00'",
    ),
    (
        "carriage return in an env value",
        GOOD + '\n[runtimes.vllm.env]\nHF_HOME = "/x\\r"\n',
        "runtimes.vllm.env.HF_HOME: holds the control character '\\r'",
    ),
    (
        "newline in a model path",
        GOOD.replace('model = "/models/hf"', 'model = """/models/hf\nExecStartPre=/bin/true"""'),
        "runtimes.vllm.model: holds the control character '\\n'",
    ),
    (
        "DEL in the proxy host",
        GOOD.replace("port = 8000", 'port = 8000\nhost = "a\\u007fb"'),
        "proxy.host: holds the control character '\\x7f'",
    ),
    (
        "tab in a command word",
        GOOD.replace('["/usr/bin/true"]', '["/usr/bin/true", "a\\tb"]'),
        "runtimes.llamacpp.command[1]: holds the control character '\\t'",
    ),
    (
        "newline in a key",
        GOOD + '\n[runtimes.vllm.env]\n"A\\nB" = "x"\n',
        "runtimes.vllm.env: holds the control character '\\n'",
    ),
    (
        "a runtime named like the proxy's unit",
        GOOD.replace("[runtimes.vllm]", "[runtimes.litellm]"),
        "runtimes.litellm: 'litellm' is a name the appliance uses for its own units",
    ),
    (
        "a runtime named like the monitor",
        GOOD.replace("[runtimes.vllm]", "[runtimes.monitor]"),
        "runtimes.monitor: 'monitor' is a name the appliance uses",
    ),
    (
        "a runtime name with a double dash",
        GOOD.replace("[runtimes.vllm]", "[runtimes.a--b]"),
        "runtimes.a--b: a runtime name",
    ),
    (
        "a runtime name ending in a dash",
        GOOD.replace("[runtimes.vllm]", "[runtimes.vllm-]"),
        "runtimes.vllm-: a runtime name",
    ),
    (
        "a runtime name starting with a digit",
        GOOD.replace("[runtimes.vllm]", "[runtimes.4vllm]"),
        "runtimes.4vllm: a runtime name",
    ),
    (
        "host with a port",
        GOOD + '\n[backend]\nhost = "127.0.0.1:8001"\n',
        "backend.host: '127.0.0.1:8001' is not a host name or IP address: give the port as port = N",
    ),
    (
        "bracketed IPv6 host",
        GOOD + '\n[backend]\nhost = "[::1]"\n',
        "backend.host: '[::1]' is not a host name or IP address",
    ),
    (
        "a backend facing the network",
        GOOD + '\n[backend]\nhost = "0.0.0.0"\n',
        "backend.host: '0.0.0.0' is not a loopback address",
    ),
    (
        "backend on localhost, proxy on 127.0.0.1, one port",
        GOOD + '\n[backend]\nhost = "localhost"\nport = 8000\n',
        "backend.port: 8000 is also proxy.port, and 'localhost' overlaps '127.0.0.1'",
    ),
    (
        "proxy on every address, monitor on loopback, one port",
        GOOD.replace("port = 8000", 'port = 8000\nhost = "0.0.0.0"') + "\n[monitor]\nport = 8000\n",
        "monitor.port: 8000 is also proxy.port, and '127.0.0.1' overlaps '0.0.0.0'",
    ),
    (
        "proxy on ::, backend on ::1, one port",
        GOOD.replace("port = 8000", 'port = 8000\nhost = "::"')
        + '\n[backend]\nhost = "::1"\nport = 8000\n',
        "backend.port: 8000 is also proxy.port",
    ),
    (
        "infinite start timeout",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nstart_timeout_s = inf'),
        "runtimes.vllm.start_timeout_s: inf is not a finite number",
    ),
    (
        "NaN hold time",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nhold_s = nan'),
        "proxy.hold_s: nan is not a finite number",
    ),
    (
        "infinite memory",
        GOOD + "\n[gpu]\nmemory_needed_gib = inf\n",
        "gpu.memory_needed_gib: inf is not a finite number",
    ),
    (
        "more memory than any card",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nmemory_needed_gib = 1e300'),
        "runtimes.vllm.memory_needed_gib: 1e+300 must be at most 1024",
    ),
    (
        "a start timeout of a year",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nstart_timeout_s = 31536000'),
        "runtimes.vllm.start_timeout_s: 31536000.0 must be at most 86400",
    ),
    (
        "a huge integer",
        GOOD.replace(
            'model = "/models/hf"', 'model = "/models/hf"\nrestart_burst = 9223372036854775807'
        ),
        "runtimes.vllm.restart_burst: 9223372036854775807 must be at most 100",
    ),
    (
        "a command with systemd's privilege prefix",
        GOOD.replace('["/usr/bin/true"]', '["+/usr/bin/true"]'),
        "runtimes.llamacpp.command[0]: '+/usr/bin/true' starts with '+', which systemd reads as a prefix",
    ),
    (
        "an image that is a flag",
        GOOD.replace(
            'engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"\nimage = "--privileged"'
        ),
        "runtimes.vllm.image: '--privileged' is not a container image reference",
    ),
    (
        "a model that is a flag",
        GOOD.replace('model = "/models/hf"', 'model = "--trust-remote-code"'),
        "runtimes.vllm.model: '--trust-remote-code' starts with '-'",
    ),
    (
        "a pass-through that is not a boolean",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\npass_through = "no"'),
        "proxy.pass_through: must be true or false, not a string ('no')",
    ),
    (
        "fair turns that are not a boolean",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = 1'),
        "proxy.fair: must be true or false",
    ),
    (
        "a batch wait below zero",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nbatch_wait_s = -1'),
        "proxy.batch_wait_s",
    ),
    (
        "more places kept than a runtime could have",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nkeep_free = 5000'),
        "proxy.keep_free",
    ),
    (
        "no body at all",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nmax_body_mib = 0'),
        "proxy.max_body_mib: 0.0 must be greater than 0",
    ),
    (
        "a relative device",
        GOOD.replace(
            'engine = "vllm"',
            'engine = "vllm"\nlauncher = "docker"\nimage = "vllm/vllm:1"\ndevices = ["dri"]',
        ),
        "runtimes.vllm.devices[0]: 'dri' must start with an absolute path",
    ),
]
PEERS = [
    (
        "peer without a port",
        GOOD + '[peers]\nurls = ["http://10.0.0.2"]\n',
        "peers.urls[0]: 'http://10.0.0.2' has no port",
    ),
    (
        "peer over ftp",
        GOOD + '[peers]\nurls = ["ftp://10.0.0.2:8000"]\n',
        "peers.urls[0]: 'ftp://10.0.0.2:8000' is not an http:// or https://HOST:PORT",
    ),
    (
        "peer with a path",
        GOOD + '[peers]\nurls = ["http://10.0.0.2:8000/v1"]\n',
        "only http(s)://HOST:PORT",
    ),
    (
        "peer twice",
        GOOD + '[peers]\nurls = ["http://a:8000", "http://a:8000"]\n',
        "peers.urls[1]: http://a:8000 is listed twice",
    ),
    (
        "redis without peers",
        GOOD + '[peers]\nredis_host = "10.0.0.9"\n',
        "peers.redis_host: is for front doors with peers",
    ),
    (
        "the proxy's old litellm executable",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nlitellm = "/usr/local/bin/litellm"'),
        "proxy.litellm: is no longer read: the proxy runs as b70-proxy",
    ),
    (
        "no place for batch keys",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nbatch_share = 0'),
        "proxy.batch_share: 0.0 must be greater than 0",
    ),
    (
        "batch_share without fair turns",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = false\nbatch_share = 0.5'),
        "proxy.batch_share: does nothing with fair = false",
    ),
    (
        "keep_free without fair turns",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = false\nkeep_free = 1'),
        "proxy.keep_free: does nothing with fair = false",
    ),
    (
        "batch_wait_s without fair turns",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = false\nbatch_wait_s = 5'),
        "proxy.batch_wait_s: does nothing with fair = false",
    ),
    (
        "redis tls without redis",
        GOOD + '[peers]\nurls = ["http://a:8000"]\nredis_tls = true\n',
        "peers.redis_tls: is for a shared Redis: set peers.redis_host",
    ),
    (
        "redis ca without tls",
        GOOD + '[peers]\nurls = ["http://a:8000"]\nredis_host = "r"\nredis_ca = "/ca.pem"\n',
        "peers.redis_ca: is for a Redis that speaks TLS: set redis_tls = true",
    ),
    (
        "redis tls not a boolean",
        GOOD + '[peers]\nurls = ["http://a:8000"]\nredis_host = "r"\nredis_tls = "yes"\n',
        "peers.redis_tls",
    ),
    (
        "peers without the door's way",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\npass_through = false')
        + '[peers]\nurls = ["http://a:8000"]\n',
        "peers need proxy.pass_through",
    ),
    (
        "replicas named like a runtime",
        GOOD.replace(
            'model = "/models/hf"',
            'model = "/models/hf"\ncards = [0, 1]\nper_card = true\n[runtimes.vllm-1]\nengine = "vllm"\nmodel = "/m"\ncards = [2]\nport = 8009',
        ),
        "runtimes.vllm.per_card: its replica on card 1 would be named 'vllm-1'",
    ),
]
BAD += REACH + PEERS
PODMAN = 'engine = "vllm"\nlauncher = "podman"\nimage = "localhost/vllm:1"'
CONTAINER_OPTIONS = [
    (
        "container options on a native runtime",
        GOOD.replace('["/usr/bin/true"]', '["/usr/bin/true"]\ncontainer_options = ["--init"]'),
        "runtimes.llamacpp.container_options: only container launchers take container options",
    ),
    (
        "container options that name the container",
        GOOD.replace(
            'engine = "vllm"', PODMAN + '\ncontainer_options = ["--init", "--name=other"]'
        ),
        "runtimes.vllm.container_options[1]: may not set --name: the appliance names the "
        "container b70-NAME",
    ),
    (
        "a container option that detaches",
        GOOD.replace('engine = "vllm"', PODMAN + '\ncontainer_options = ["-dit"]'),
        "runtimes.vllm.container_options[0]: may not set -d: the unit runs the container in "
        "the foreground",
    ),
    (
        "a volume among the container options",
        GOOD.replace('engine = "vllm"', PODMAN + '\ncontainer_options = ["--volume", "/srv:/srv"]'),
        "runtimes.vllm.container_options[0]: may not set --volume: use runtimes.NAME.volumes",
    ),
    (
        "a container option that is an image",
        GOOD.replace('engine = "vllm"', PODMAN + '\ncontainer_options = ["runc"]'),
        "runtimes.vllm.container_options[0]: 'runc' is neither an option nor the value of one",
    ),
    (
        "a word after an option with its value",
        GOOD.replace(
            'engine = "vllm"',
            PODMAN + '\ncontainer_options = ["--ulimit=nofile=1024:1024", "other/image"]',
        ),
        "runtimes.vllm.container_options[1]: 'other/image' is neither an option nor the value",
    ),
    (
        "container options that are not a list",
        GOOD.replace('engine = "vllm"', PODMAN + '\ncontainer_options = "--runtime runc"'),
        "runtimes.vllm.container_options: must be a list of strings",
    ),
    (
        "an empty container option",
        GOOD.replace('engine = "vllm"', PODMAN + '\ncontainer_options = ["--init", " "]'),
        "runtimes.vllm.container_options[1]: must not be empty",
    ),
]
BAD += CONTAINER_OPTIONS
