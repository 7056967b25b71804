// Stop strings matched on decoded text with hold-back: text that could still become a stop string
// is not released, and the stop string itself is never released (FRONTEND.md §1.4).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends decoded text; returns the text that is now safe to emit. After a stop string is found
  // stopped() is true, the returned text ends right before it, and later pushes return nothing.
  std::string push(std::string_view text);
  // End of generation without a stop string: releases the held-back text.
  std::string flush();

  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }   // the stop string that ended it

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace lily
