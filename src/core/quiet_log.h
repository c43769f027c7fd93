// A scope that says less: the log level raised to at least `floor` while it lives, and put back
// however the scope ends — for work whose messages are said elsewhere already (every rank
// parsing the same config; trial parses of a config the user was warned about when it was read).
#pragma once

#include "strata/log.h"

namespace strata::log {

class Quiet {
 public:
  explicit Quiet(Level floor, bool on = true) : saved_(level()) {
    if (on && saved_ < floor) set_level(floor);
  }
  ~Quiet() { set_level(saved_); }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  Level saved_;
};

}  // namespace strata::log
