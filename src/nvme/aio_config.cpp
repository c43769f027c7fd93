// The "aio" block of a ds_config.json: DeepSpeed's keys with their defaults, plus strata's.
#include "core/json_config.h"
#include "strata/error.h"
#include "strata/nvme.h"

namespace strata {

const char* io_backend_name(IoBackend b) {
  switch (b) {
    case IoBackend::kAuto:
      return "auto";
    case IoBackend::kIoUring:
      return "io_uring";
    case IoBackend::kThreads:
      return "threads";
  }
  return "?";
}

namespace {

const std::initializer_list<std::string_view> kKeys = {
    "block_size",    "queue_depth",    "thread_count",     "intra_op_parallelism",
    "single_submit", "overlap_events", "use_hugepages",    "verify",
    "engine",        "direct",         "register_buffers", "use_gds"};

// Either a whole ds_config (its "aio" key; none: nullptr, the defaults) or an "aio" object
// itself: one with any aio key, or a key a typo away from one. (A block with a typo among
// good keys used to be taken for a ds_config without aio: the defaults, silently.)
const config::Json* aio_block(const config::Json& doc) {
  if (doc.is_object() && doc.contains("aio")) return &doc["aio"];
  if (!doc.is_object()) return &doc;  // (refused as the aio block it is not)
  // (near_miss finds an exact key too: every aio key is 5 characters or more)
  for (auto it = doc.begin(); it != doc.end(); ++it)
    if (!config::near_miss(it.key(), kKeys).empty()) return &doc;
  return nullptr;
}

}  // namespace

bool has_aio_block(std::string_view json_text) {
  return aio_block(config::parse(json_text, "the aio config")) != nullptr;
}

AioConfig parse_aio_config(std::string_view json_text) {
  const config::Json doc = config::parse(json_text, "the aio config");
  const config::Section s(aio_block(doc), "aio");
  s.warn_unknown(kKeys);

  AioConfig c;
  const std::uint64_t bs = s.get_uint("block_size", c.block_size);
  STRATA_REQUIRE(bs >= 4096 && (bs & (bs - 1)) == 0 && bs <= (std::uint64_t(1) << 30),
                 "config key '{}' = {}: must be a power of two from 4096 (4 KiB) to 1073741824 "
                 "(1 GiB); 1048576 is a good start",
                 s.key_path("block_size"), bs);
  c.block_size = bs;
  const std::int64_t qd = s.get_int("queue_depth", c.queue_depth);
  STRATA_REQUIRE(qd >= 1 && qd <= 4096,
                 "config key '{}' = {}: must be from 1 to 4096 (8-64 is typical)",
                 s.key_path("queue_depth"), qd);
  c.queue_depth = static_cast<int>(qd);
  STRATA_REQUIRE(!(s.has("thread_count") && s.has("intra_op_parallelism")) ||
                     s.get_int("thread_count", 1) == s.get_int("intra_op_parallelism", 1),
                 "config keys '{}' and '{}' disagree: they are the same setting, give one",
                 s.key_path("thread_count"), s.key_path("intra_op_parallelism"));
  const std::int64_t th = s.has("thread_count") ? s.get_int("thread_count", 1)
                                                : s.get_int("intra_op_parallelism", c.thread_count);
  STRATA_REQUIRE(th >= 1 && th <= 64, "config key '{}' = {}: must be from 1 to 64",
                 s.key_path(s.has("thread_count") ? "thread_count" : "intra_op_parallelism"), th);
  c.thread_count = static_cast<int>(th);
  c.single_submit = s.get_bool("single_submit", c.single_submit);
  c.overlap_events = s.get_bool("overlap_events", c.overlap_events);
  c.use_hugepages = s.get_bool("use_hugepages", c.use_hugepages);
  c.verify = s.get_bool("verify", c.verify);
  STRATA_REQUIRE(!s.get_bool("use_gds", false),
                 "config key '{}' = true: GPUDirect Storage is not supported by strata; remove it "
                 "(strata stages NVMe I/O through pinned host memory)",
                 s.key_path("use_gds"));
  const std::string engine = s.get_choice("engine", "auto", {"auto", "io_uring", "threads"});
  c.engine = engine == "io_uring"  ? IoBackend::kIoUring
             : engine == "threads" ? IoBackend::kThreads
                                   : IoBackend::kAuto;
  if (const auto* d = s.raw("direct")) {
    if (d->is_boolean()) {
      c.direct = d->get<bool>() ? DirectIo::kOn : DirectIo::kOff;
    } else {
      STRATA_REQUIRE(d->is_string() && d->get<std::string>() == "auto",
                     "config key '{}' = {}: use true, false or \"auto\"", s.key_path("direct"),
                     d->dump());
    }
  }
  c.register_buffers = s.get_bool("register_buffers", c.register_buffers);
  return c;
}

}  // namespace strata
