#include "transport/matching.h"

#include <algorithm>
#include <cstring>

#include "transport/error.h"

namespace mk {

std::string Matcher::mismatch(const Envelope& env, size_t len, uint64_t check, bool up_to) const {
  if (up_to && env.len > len)
    return cat("rank ", rank_, " expected at most ", len, " bytes from peer ", env.src, " (tag ", env.tag,
               ") but the peer sent ", env.len, " bytes");
  if (!up_to && env.len != len)
    return cat("rank ", rank_, " expected ", len, " bytes from peer ", env.src, " (tag ", env.tag,
               ") but the peer sent ", env.len, " bytes: the ranks disagree on the size of the operation");
  if (env.check != check)
    return cat("rank ", rank_, " and peer ", env.src, " disagree on the operation (tag ", env.tag,
               "): different collective, dtype, count or root on the two ranks");
  return {};
}

ArrivalPtr Matcher::arrive(const Envelope& env) {
  auto a = std::make_shared<Arrival>();
  a->env = env;
  RequestPtr refused;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(posted_.begin(), posted_.end(), [&](const Posted& p) {
      return (p.src == env.src || p.src == kAnySource) && p.tag == env.tag;
    });
    if (it != posted_.end()) {
      Posted p = *it;
      posted_.erase(it);
      why = mismatch(env, p.len, p.check, p.up_to);
      if (why.empty()) {
        a->req = p.req;
        a->dst = static_cast<char*>(p.buf);  // the payload goes straight into the user's buffer
        return a;
      }
      refused = p.req;  // wrong size or operation: the recv fails, the payload is taken and dropped
    } else {
      unexpected_.push_back(a);
    }
    a->storage.resize(env.len);
    a->dst = a->storage.data();
  }
  if (refused) refused->fail(why);  // outside the lock: failing runs the waiter's callbacks
  return a;
}

void Matcher::delivered(const ArrivalPtr& a) {
  RequestPtr req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a->delivered = true;
    req = a->req;
    if (req && a->user_buf && a->env.len) std::memcpy(a->user_buf, a->dst, a->env.len);
  }
  if (req) req->complete(a->env.len, a->env.src);
}

RequestPtr Matcher::post_recv(int src, uint64_t tag, void* buf, size_t len, uint64_t check, bool up_to) {
  auto req = std::make_shared<Request>();
  ArrivalPtr ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(unexpected_.begin(), unexpected_.end(), [&](const ArrivalPtr& a) {
      return (src == a->env.src || src == kAnySource) && a->env.tag == tag;
    });
    if (it == unexpected_.end()) {
      posted_.push_back(Posted{src, tag, buf, len, check, up_to, req});
      return req;
    }
    ArrivalPtr a = *it;
    unexpected_.erase(it);
    if (std::string bad = mismatch(a->env, len, check, up_to); !bad.empty()) {
      req->fail(bad);
      return req;
    }
    if (!a->delivered) {  // still arriving: delivered() copies it into buf
      a->req = req;
      a->user_buf = buf;
      return req;
    }
    ready = std::move(a);
  }
  if (ready->env.len) std::memcpy(buf, ready->dst, ready->env.len);
  req->complete(ready->env.len, ready->env.src);
  return req;
}

void Matcher::abandon(const ArrivalPtr& a, const std::string& why) {
  RequestPtr req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    req = a->req;
    a->req = nullptr;
    unexpected_.remove(a);
  }
  if (req) req->fail(why);
}

void Matcher::cancel(const RequestPtr& req, const std::string& why) {
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end(); ++it)
      if (it->req == req) {
        posted_.erase(it);
        found = true;
        break;
      }
  }
  if (found) req->fail(why);
}

void Matcher::fail_source(int src, const std::string& why) {
  std::vector<RequestPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end();) {
      if (it->src == src || it->src == kAnySource) {
        victims.push_back(it->req);
        it = posted_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& r : victims) r->fail(why);
}

void Matcher::fail_all(const std::string& why) {
  std::vector<RequestPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : posted_) victims.push_back(p.req);
    posted_.clear();
  }
  for (auto& r : victims) r->fail(why);
}

}  // namespace mk
